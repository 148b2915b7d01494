"""One token's attention over a session's KV cache as one hand-written C kernel, for decode on the CPU.

tinygrad runs a decode token's attention as five kernels a block, each on one thread: the scores, the softmax's
max, sum and scaling, and the weighted values. The scores kernel reads the cache through tinygrad's view of the
transposed, GQA-repeated slice, with a division and a remainder by the symbolic length per element: on the bench
model at position 100 a block's attention took 0.1 ms, a third of a stage's decode call (bench/NOTES.md). This
kernel does all of it in one pass per key head: each key and value, read once as 16-wide vectors, serves every
query head of its group, with an online softmax (running max and sum, rescaled per chunk of keys) so no buffer
grows with the position. The key heads split over the threads.

Same math as tinygrad's `scaled_dot_product_attention` in float32 (q . k / sqrt(head_dim), softmax, weighted sum
of values), summed in another order: results agree to rounding, not bit for bit (the tests compare with numpy).
It runs through `cpu_kernels.launch`, with the position as a variable of the compiled forward, like the products.
"""

from __future__ import annotations

import math

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.helpers import CPU_COUNT

from pp_worker.worker.engines.cpu_kernels import HEADER, launch

CHUNK = 128  # keys scored per step of the online softmax

# exp(x) for x <= 0 (scores minus their running max): 2^n * p(r), ggml's and Cephes' range reduction and polynomial
# (relative error ~1e-7), written with plain arithmetic so the loops over a chunk vectorize
EXP = r"""
static inline float pexp(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
             + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, ((int)n + 127) << 23);
}
"""

# out (H * D) = attention of q (H * D) over keys and values [0, start_pos] of row dims[0] of the cache, laid out
# (rows, 2, 1, KVH, CTX, D) in CT (float or __fp16). Query head h reads key head h / (H / KVH).
KERNEL = r"""
static inline f16v load16(const CT* p) {
#if IS_HALF
  h16x16 v; __builtin_memcpy(&v, p, 32); return __builtin_convertvector(v, f16v);
#else
  return f_at(p);
#endif
}
void NAME(float* restrict out, const CT* restrict cache, const float* restrict q, const int* restrict dims,
          int core_id, int start_pos) {
  enum { H = %(h)d, KVH = %(kvh)d, D = %(d)d, CTX = %(ctx)d, G = H / KVH, V = D / 16, C = %(chunk)d, T = %(threads)d };
  const int len = start_pos + 1;
  const float scale = %(scale)s;
  for (int kh = core_id; kh < KVH; kh += T) {
    const CT* keys = cache + (((long)dims[0] * 2 * KVH + kh) * CTX) * D;
    const CT* vals = keys + (long)KVH * CTX * D;
    f16v qv[G][V], acc[G][V];
    float m[G], l[G], s[G][C];
    for (int g = 0; g < G; g++) {
      for (int v = 0; v < V; v++) { qv[g][v] = f_at(q + (kh * G + g) * D + 16 * v); acc[g][v] = 0; }
      m[g] = -__builtin_inff(); l[g] = 0;
    }
    for (int t0 = 0; t0 < len; t0 += C) {
      int n = len - t0 < C ? len - t0 : C;
      for (int t = 0; t < n; t++) {  /* scores: each key once for the G query heads */
        f16v d[G];
        for (int g = 0; g < G; g++) d[g] = 0;
        for (int v = 0; v < V; v++) {
          f16v k = load16(keys + (long)(t0 + t) * D + 16 * v);
          for (int g = 0; g < G; g++) d[g] += qv[g][v] * k;
        }
        for (int g = 0; g < G; g++) s[g][t] = hsum(d[g]) / scale;
      }
      for (int g = 0; g < G; g++) {  /* the running max; what was summed before it rose is rescaled */
        float mx = m[g];
        for (int t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        float f = pexp(m[g] - mx);
        l[g] *= f;
        for (int v = 0; v < V; v++) acc[g][v] *= f;
        m[g] = mx;
        for (int t = 0; t < n; t++) { s[g][t] = pexp(s[g][t] - mx); l[g] += s[g][t]; }
      }
      for (int t = 0; t < n; t++)  /* weighted values: each value once for the G query heads */
        for (int v = 0; v < V; v++) {
          f16v x = load16(vals + (long)(t0 + t) * D + 16 * v);
          for (int g = 0; g < G; g++) acc[g][v] += s[g][t] * x;
        }
    }
    for (int g = 0; g < G; g++)
      for (int v = 0; v < V; v++) {
        f16v o = acc[g][v] / l[g];
        __builtin_memcpy(out + (kh * G + g) * D + 16 * v, &o, 64);
      }
  }
}
"""

CACHE_TYPES: dict[DType, tuple[str, int]] = {dtypes.float32: ("float", 0), dtypes.float16: ("__fp16", 1)}


def supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel covers these heads: whole 16-float vectors per head, whole groups per key head."""
    return head_dim % 16 == 0 and n_heads % n_kv_heads == 0


def source(name: str, n_heads: int, n_kv_heads: int, head_dim: int, max_context: int, dtype: DType,
           threads: int) -> str:
    ctype, half = CACHE_TYPES[dtype]
    body = KERNEL % {"h": n_heads, "kvh": n_kv_heads, "d": head_dim, "ctx": max_context, "chunk": CHUNK,
                     "threads": threads, "scale": f"{math.sqrt(head_dim)!r}f"}
    return f"{HEADER}{EXP}#define CT {ctype}\n#define IS_HALF {half}\n{body.replace('NAME', name)}"


def attend(q: Tensor, cache: Tensor, row: int, start_pos: UOp) -> Tensor:
    """Attention of one token's queries ``q`` (1, H, 1, D) over positions [0, start_pos] of block ``row`` of
    ``cache`` (rows, 2, 1, KvH, max_context, D), whose store of this token's key and value must come first (pass the
    cache after it): (1, 1, H * D) float32."""
    _, n_heads, _, head_dim = q.shape
    n_kv_heads, max_context = cache.shape[3], cache.shape[4]
    threads = max(1, min(CPU_COUNT.value, n_kv_heads))
    name = f"attend_{n_heads}_{n_kv_heads}_{head_dim}_{max_context}_{cache.dtype.name}_{threads}"
    src = source(name, n_heads, n_kv_heads, head_dim, max_context, cache.dtype, threads)
    out = Tensor.empty(n_heads * head_dim, dtype=dtypes.float32, device=q.device)
    qs = q.reshape(n_heads * head_dim).cast(dtypes.float32).contiguous()
    return launch(name, src, (out, cache, qs), (row,), threads, (start_pos,)).reshape(1, 1, n_heads * head_dim)
