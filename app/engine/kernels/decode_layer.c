/* One Llama decoder layer of a decode step, in one call from Python (issue 16).
 *
 * A one-token step of a 30-layer model makes about 300 kernel calls, and each Python wrapper spends ~15 us
 * checking its tensors and packing ctypes arguments: several milliseconds per token, as much as the products
 * of a 4-bit model take. Here the layer's weights and shapes are checked once (decode_layer.py builds the
 * structs) and this function runs the same kernels with the same arguments, in the same order, as the Python
 * layer does: the numbers are bit-identical, only the dispatch is gone.
 */
#include <stdint.h>

int decode_layer_abi_version(void) { return 6; }

void add_rms_norm(const void* x, int64_t x_ld, float* residual, int64_t res_ld, int flags, const float* weight,
                  float eps, void* out, int64_t out_ld, int64_t rows, int64_t dim, int num_threads, int use_pool);
void silu_mul(const void* gu, int64_t gu_ld, void* out, int64_t out_ld, int64_t rows, int64_t inter, int bf16,
              int num_threads, int use_pool);
void rope_inplace(void* x, int64_t x_ld, const float* cos_t, const float* sin_t, int64_t cs_ld, int64_t rows,
                  int64_t heads, int64_t head_dim, int bf16, int num_threads, int use_pool);
void write_kv(const void* k, int64_t k_ld, const void* v, int64_t v_ld, const int64_t* slots, int64_t tokens,
              int64_t row, void* k_cache, void* v_cache, int bf16, int src_bf16, int num_threads, int use_pool);
void paged_decode_attention(const void* q, int64_t q_ld, const void* k_cache, const void* v_cache, int kv_bf16,
                            int bf16_values, int io_bf16, const int64_t* block_tables, int64_t bt_stride,
                            const int64_t* context_lens, const int64_t* rows, int64_t num_seqs, int64_t heads,
                            int64_t kvh, int64_t hd, int64_t bs, float scale, void* out, int64_t out_ld,
                            float* scratch, int64_t scratch_per_thread, int64_t max_context, int num_threads,
                            int use_pool);
int qblock_matmul(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const uint16_t* d,
                  const uint16_t* m, int bits, int offset, int has_min, int64_t N, const float* bias, float* out,
                  int64_t ldo, void* scratch, int isa, int threads, int use_pool);
void small_matmul(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t M, int64_t K, int64_t N, float* scratch, int num_threads, int use_pool);
void bf16_gemm(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t K, int64_t N, int64_t M, void* y,
               int64_t ldy, int out_f32, int num_threads, int use_pool);
void bf16_gemm_swiglu(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t K, int64_t inter, int64_t M,
                      uint16_t* y, int64_t ldy, int num_threads, int use_pool);

/* LINEAR_BF16_SWIGLU: the gate_up projection packed for bf16_gemm_swiglu, which also applies SwiGLU */
enum { LINEAR_F32 = 0, LINEAR_QBLOCK = 1, LINEAR_BF16 = 2, LINEAR_BF16_SWIGLU = 3 };

/* A projection: a float32 weight stored transposed ([in, out] contiguous, small_matmul's layout), a GGUF
 * block matrix (qblock_matmul's) or a bfloat16 weight packed for bf16_gemm (no bias). Field order matches
 * decode_layer.py's ctypes structures. */
typedef struct {
  const void* w; /* float32 W^T, the block codes, or the packed bfloat16 W */
  const uint16_t* d;
  const uint16_t* m;
  const float* bias;
  int64_t in, out;
  int32_t kind, bits, offset, has_min; /* kind: LINEAR_* */
} dl_linear;

typedef struct {
  const float* in_norm;
  const float* post_norm;
  void* k_cache;
  void* v_cache;
  dl_linear qkv, o, gate_up, down;
  int64_t hidden, inter, heads, kv_heads, head_dim, block_size;
  float eps, scale;
  int32_t kv_bf16;
  int32_t bf16_rows; /* bfloat16 weights: the rows between norms, products and attention are bfloat16 */
} dl_layer;

/* What every layer of one step shares: the step's metadata and buffers (decode_layer.py allocates them). */
typedef struct {
  const float* cos;
  const float* sin;
  const int64_t* slots;
  const int64_t* tables;
  const int64_t* context_lens;
  const int64_t* rows;
  void *h, *qkv, *attn, *gate_up, *mid; /* float32, or bfloat16 for a layer with bf16_rows */
  float* scratch;
  int64_t tokens, bt_stride, seqs, max_context, attn_per_thread;
  int32_t threads, use_pool, isa;
  int32_t attn_mode; /* paged_decode_attention's bf16_values: 0 float32 values, 2 bfloat16 products */
} dl_step;

/* y = x @ p^T */
static int project(const dl_linear* p, const dl_step* s, const void* x, void* y) {
  if (p->kind == LINEAR_BF16) {
    bf16_gemm((const uint16_t*)x, p->in, (const uint16_t*)p->w, p->in, p->out, s->tokens, y, p->out, 0, s->threads,
              s->use_pool);
    return 0;
  }
  if (p->kind == LINEAR_QBLOCK)
    return qblock_matmul(x, p->in, s->tokens, p->in, (const uint8_t*)p->w, p->d, p->m, p->bits, p->offset,
                         p->has_min, p->out, p->bias, y, p->out, s->scratch, s->isa, s->threads, s->use_pool);
  small_matmul(x, p->in, (const float*)p->w, p->bias, y, p->out, s->tokens, p->in, p->out, s->scratch, s->threads,
               s->use_pool);
  return 0;
}

/* residual += x (residual = x where has_residual is 0: then residual must be x), then the attention and MLP
 * blocks; `out` gets the MLP's output. `out` may be x: x is read only by the first norm. Nonzero on failure
 * (a block matrix the kernel refuses), before anything was written past the first norm's rows.
 *
 * With bf16_rows (a bfloat16 model), as its Python layer runs: `x` is bfloat16 after the first layer (float32,
 * the embeddings, before it), the normed rows, q/k/v, the attention output, the MLP's middle and `out` are
 * bfloat16, and the residual stream stays float32. */
int decode_layer(const dl_layer* L, const dl_step* s, const void* x, float* residual, int has_residual, void* out) {
  const int64_t t = s->tokens, hd = L->head_dim, q_size = L->heads * hd, kv_size = L->kv_heads * hd;
  const int64_t qkv_ld = L->qkv.out;
  const int b = L->bf16_rows ? 1 : 0;
  const int64_t word = b ? 2 : 4; /* bytes per value of the rows between kernels */
  char* qkv = (char*)s->qkv;
  const int first_flags = has_residual | (b && has_residual) << 1 | b << 2, later_flags = 1 | b << 1 | b << 2;
  add_rms_norm(x, L->hidden, residual, L->hidden, first_flags, L->in_norm, L->eps, s->h, L->hidden, t, L->hidden,
               s->threads, s->use_pool);
  if (project(&L->qkv, s, s->h, qkv)) return 1;
  rope_inplace(qkv, qkv_ld, s->cos, s->sin, hd / 2, t, L->heads + L->kv_heads, hd, b, s->threads, s->use_pool);
  write_kv(qkv + q_size * word, qkv_ld, qkv + (q_size + kv_size) * word, qkv_ld, s->slots, t, kv_size, L->k_cache,
           L->v_cache, L->kv_bf16, b, s->threads, s->use_pool);
  paged_decode_attention(qkv, qkv_ld, L->k_cache, L->v_cache, L->kv_bf16, s->attn_mode, b, s->tables, s->bt_stride,
                         s->context_lens, s->rows, s->seqs, L->heads, L->kv_heads, hd, L->block_size, L->scale,
                         s->attn, q_size, s->scratch, s->attn_per_thread, s->max_context, s->threads, s->use_pool);
  if (project(&L->o, s, s->attn, out)) return 1;
  add_rms_norm(out, L->hidden, residual, L->hidden, later_flags, L->post_norm, L->eps, s->h, L->hidden, t,
               L->hidden, s->threads, s->use_pool);
  if (L->gate_up.kind == LINEAR_BF16_SWIGLU) {
    bf16_gemm_swiglu((const uint16_t*)s->h, L->hidden, (const uint16_t*)L->gate_up.w, L->hidden, L->inter, t,
                     (uint16_t*)s->mid, L->inter, s->threads, s->use_pool);
  } else {
    if (project(&L->gate_up, s, s->h, s->gate_up)) return 1;
    silu_mul(s->gate_up, 2 * L->inter, s->mid, L->inter, t, L->inter, b, s->threads, s->use_pool);
  }
  return project(&L->down, s, s->mid, out);
}
