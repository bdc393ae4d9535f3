/* The kernels' thread pool: see threadpool.h for why it is not OpenMP.
 *
 * A job is published as one 64-bit ticket, [generation:16 | chunks:24 | next:24]. A thread claims chunk `next`
 * by a compare-and-swap that advances it; a successful claim proves the job still had unclaimed chunks, so its
 * caller is still inside parallel_for and fn/ctx are still that job's. A worker that slept through a whole
 * job simply finds nothing to claim, and the caller waits only for chunks that were claimed, never for a
 * worker to wake up. Workers spin briefly after a job (decoding issues the next one within microseconds),
 * then sleep on a futex.
 */
#define _GNU_SOURCE
#include "threadpool.h"

#include <immintrin.h>
#include <limits.h>
#include <omp.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define MAX_CHUNKS ((1 << 24) - 1)
#define SPIN_NS 200000L /* a worker spins this long for the next job before sleeping */

static _Atomic uint64_t ticket;         /* the current job: generation, chunk count, next chunk */
static _Atomic int64_t done;            /* chunks of the current job finished */
static _Atomic uint32_t wake;           /* futex word: bumped for every job */
static _Atomic int sleepers;            /* workers blocked on the futex */
static _Atomic int allowed;             /* workers that may take part in the current job */
static chunk_fn job_fn;                 /* written before the ticket is published, read after a claim */
static void* job_ctx;
static uint64_t generation;             /* master side only (under master_lock) */

static pthread_mutex_t master_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static int nworkers;
static pid_t pool_pid;
static __thread int worker_slot; /* 0 outside the pool's workers, else worker id + 1 */

static inline uint64_t pack(uint64_t gen, uint64_t n, uint64_t next) {
  return (gen & 0xFFFF) << 48 | (n & MAX_CHUNKS) << 24 | (next & MAX_CHUNKS);
}

static long futex(_Atomic uint32_t* addr, int op, uint32_t val) {
  return syscall(SYS_futex, (uint32_t*)addr, op, val, NULL, NULL, 0);
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run chunks of the current job until none is left. */
static void work(void) {
  uint64_t t = atomic_load(&ticket);
  for (;;) {
    uint64_t n = (t >> 24) & MAX_CHUNKS, next = t & MAX_CHUNKS;
    if (next >= n) return;
    if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) {
      job_fn(job_ctx, (int64_t)next);
      atomic_fetch_add(&done, 1);
      t = atomic_load(&ticket);
    }
  }
}

static void* worker_main(void* arg) {
  int id = (int)(intptr_t)arg;
  worker_slot = id + 1;
  uint32_t seen = atomic_load(&wake);
  for (;;) {
    uint32_t w = atomic_load(&wake);
    if (w == seen) {
      int64_t start = now_ns();
      int spins = 0;
      while ((w = atomic_load(&wake)) == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && now_ns() - start > SPIN_NS) {
          atomic_fetch_add(&sleepers, 1);
          futex(&wake, FUTEX_WAIT_PRIVATE, seen); /* returns at once if wake moved on meanwhile */
          atomic_fetch_sub(&sleepers, 1);
          start = now_ns();
        }
      }
    }
    seen = w;
    if (id < atomic_load(&allowed)) work();
  }
  return NULL;
}

/* Start workers up to `want` (never more than MAX_WORKERS); called with master_lock held. */
static void ensure_workers(int want) {
  if (pool_pid != getpid()) { /* a forked child inherits no threads */
    pool_pid = getpid();
    nworkers = 0;
  }
  if (want > MAX_WORKERS) want = MAX_WORKERS;
  while (nworkers < want) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&th, &attr, worker_main, (void*)(intptr_t)nworkers);
    pthread_attr_destroy(&attr);
    if (failed) break;
    nworkers++;
  }
}

void parallel_for(int64_t n, chunk_fn fn, void* ctx, int threads, int use_pool) {
  if (n <= 0) return;
  if (!use_pool && threads > 1 && n > 1) {
    int t = n < threads ? (int)n : threads;
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
    for (int64_t c = 0; c < n; c++) fn(ctx, c);
    return;
  }
  /* Serial: one thread asked for, one chunk, a call from inside a chunk, or another thread's job running. */
  if (threads <= 1 || n == 1 || n > MAX_CHUNKS || worker_slot || pthread_mutex_trylock(&master_lock) != 0) {
    for (int64_t c = 0; c < n; c++) fn(ctx, c);
    return;
  }
  ensure_workers(threads - 1);
  job_fn = fn;
  job_ctx = ctx;
  atomic_store(&done, 0);
  atomic_store(&allowed, threads - 1);
  atomic_store(&ticket, pack(++generation, (uint64_t)n, 0)); /* publishes fn, ctx and done */
  atomic_fetch_add(&wake, 1);
  if (atomic_load(&sleepers) > 0) futex(&wake, FUTEX_WAKE_PRIVATE, INT_MAX);
  work();
  while (atomic_load(&done) < n) _mm_pause(); /* only chunks that a worker claimed and is running */
  pthread_mutex_unlock(&master_lock);
}

int thread_slot(void) { return worker_slot ? worker_slot : omp_get_thread_num(); }
