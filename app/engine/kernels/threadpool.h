/* A "help if you can" thread pool for the engine's C kernels.
 *
 * parallel_for(n, fn, ctx, threads) runs fn(ctx, 0..n-1); the calling thread claims chunks itself and the pool's
 * workers join in while they are awake, so the call never waits for a worker that has not started a chunk.
 * OpenMP would: every parallel region ends in a barrier, and on a machine where other processes hold a core
 * the thread that shares it arrives late, a scheduler time slice (milliseconds) per region, hundreds of
 * regions per decoded token. Here the worst case is the single-threaded time.
 *
 * Which thread runs a chunk never changes the numbers: callers give every chunk its own output.
 */
#ifndef INF_ENGINE_THREADPOOL_H
#define INF_ENGINE_THREADPOOL_H

#include <stdint.h>

typedef void (*chunk_fn)(void* ctx, int64_t chunk);

/* Run fn(ctx, c) for c in [0, n) on up to `threads` threads; returns when all are done. With use_pool, the
 * caller and this pool's workers; without, an OpenMP loop. Use the pool when the step is made of the kernels
 * alone (few tokens: small_matmul does the products), OpenMP when MKL's GEMMs run in between: they use
 * OpenMP's threads, and two sets of threads spinning for work on two cores would slow each other down. */
void parallel_for(int64_t n, chunk_fn fn, void* ctx, int threads, int use_pool);

/* Index of the calling thread among those running the current parallel_for, in [0, threads): for per-thread
 * scratch memory. */
int thread_slot(void);

#endif
