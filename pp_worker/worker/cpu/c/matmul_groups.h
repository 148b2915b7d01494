/* The integer path's product (matmul_int.c's NAME) for weights whose rows `gguf.tensors.grouped` interleaved at load,
   PP_GROUP (16) rows a group, a row a 32-bit lane: 32-value blocks (Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1), IQ4_XS and the
   K-quants (Q2_K, Q3_K, Q4_K, Q6_K: GROUP_K; below). The rows past the last whole group stay plain, after the groups
   (matmul_int.c's rows_pass).

   32-value blocks: block j of a group is 16 x BLOCK_BYTES bytes (a group's NB blocks one after another): the 16
   rows' d (fp16); (Q4_1, Q5_1: IQ_MIN) their m; with GROUP_FIFTH (Q5_0, Q5_1) the 16 rows' 32 fifth bits, a row a
   32-bit lane, byte t's bit k the fifth bit of value 8 (k / 2) + 4 (k % 2) + t (so chunk c's bits are bit 2c and
   2c + 1 of every byte: one vgf2p8affineqb, or a shift and a mask, puts them at bit 4 of the chunk's bytes); then 4 chunks of 64 bytes, chunk
   c's bytes 4r..4r+3 row r's: their low nibbles values 8c..8c+3 of the row's block, their high nibbles values
   8c+4..8c+7 (q, unsigned; GROUP_LEVELS: an index of IQ4_NL's levels). A chunk masked (or shifted and masked, its
   fifth bits or-ed in, its levels looked up) is then 4 values of each of the 16 rows, a row a 32-bit lane, against
   x's 4 values broadcast to every lane: vpdpbusd sums a block's 32 products of a row in the row's lane (q unsigned, x
   signed; its start value -GROUP_OFF sum x makes them (q - GROUP_OFF) x), so the 16 rows' block sums are whole int32s
   in one vector, scaled in one step (d dx, the 16 rows' d converted together). Against the plain layout's tile
   (which scales 8-lane partial sums per (row, x) and unpacks a block per row): about a fifth of the instructions per
   product (bench/NOTES.md). The float steps per (row, x): f += float(sum) (d dx) (+ m dx sum q with a min), a block
   at a time in block order, the same for one row of x or a chunk's (one function, `group_dot`), so every row of a
   chunk equals the same row alone; against the plain layout's floats they differ (whole sums, not 8 partial lanes). */
/* A group's blocks are one stream of memory, read in order: the hardware's prefetch keeps up without matmul_int.c's
   AHEAD (which, one thread from DRAM, cost Q4_0, Q5_0 and Q2_K 3-10% and Q3_K up to 45%: bench/NOTES.md) */
enum { GR = PP_GROUP, GB = GR * BLOCK_BYTES };
_Static_assert(GR == 16, "a group is 16 rows: a row per int32 lane of 512 bits");
/* rows of x a pass over a group: its unpacked block (or a step of it) and GXR rows' sums in registers */
#if !defined(__AVX512F__)
enum { GXR = 2 };
#elif BLOCK_VALUES == 32
enum { GXR = 8 };
#else
enum { GXR = 4 };  /* 256-value blocks: one or two int32 sums a row of x besides its floats */
#endif
/* a compiler barrier: the loads written before it are issued before those after it (the K-quants' order, below) */
#define IN_ORDER() __asm__ volatile("" ::: "memory")
/* v opaque to the compiler (no instruction): a chain of adds into it stays one chain, in one register */
#define KEEP(v) __asm__("" : "+x"(v))
/* acc + each lane's 4 bytes of w times the 4 bytes at x4 (int8) */
static inline i32x16 dot4(i32x16 acc, u8x64 w, const unsigned char* x4) {
  int v; __builtin_memcpy(&v, x4, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (i32x16)__builtin_ia32_vpdpbusd512(acc, (i32x16)w, (i32x16)v);  /* the broadcast folds into its operand */
#else
  i8x32 xv = (i8x32)(i32x8)v;  /* q <= 63: AVX2's 16-bit pair sums cannot saturate */
  return acc + CAT16(dot32u(LO32(w), xv), dot32u(HI32(w), xv));
#endif
}
#ifndef GROUP_FIFTH
#define GROUP_FIFTH 0
#endif
/* bits [from, from + n) of each byte moved to [to, to + n), the rest 0 (common.h's field8 on 64 bytes): a shift of
   16-bit lanes and a mask; pick64 the same by one vgf2p8affineqb where there is GFNI (its 8x8 bit matrix picks them:
   out bit i is the parity of the byte and matrix byte 7 - i). Single bits (Q5_0's and Q5_1's fifth, Q3_K's third) by
   pick64 and bit pairs by bits64 measured fastest (Q3_K's bit pairs by pick64 too: 0.96-1.0x; Q2_K's: 0.9x;
   bench/NOTES.md) */
static inline u8x64 bits64(u8x64 v, int from, int to, int n) {
  u16x32 w = (u16x32)v;
  return (u8x64)(to >= from ? w << (to - from) : w >> (from - to)) & (unsigned char)(((1 << n) - 1) << to);
}
static inline u8x64 pick64(u8x64 v, int from, int to, int n) {
#if defined(__GFNI__) && defined(__AVX512BW__)
  unsigned long long a = 0;
  for (int i = 0; i < n; i++) a |= (1ull << (from + i)) << 8 * (7 - (to + i));
  typedef long long i64x8 __attribute__((ext_vector_type(8)));
  return (u8x64)__builtin_ia32_vgf2p8affineqb_v64qi((v64qi_t)v, (v64qi_t)(i64x8)(long long)a, 0);
#else
  return bits64(v, from, to, n);
#endif
}
/* bit k of each byte of h at bit 4, the rest 0 (by GFNI 1.04-1.12x a shift of 32-bit lanes and a mask at one row of
   x, 1.0x at 8-64; bench/NOTES.md) */
static inline u8x64 fifth_bits(u32x16 h, int k) { return pick64((u8x64)h, k, 4, 1); }
#if GROUP_LEVELS  /* IQ4_NL, IQ4_XS: a nibble indexes 16 levels (iq4.h's KV4_INT), looked up 16 at a time (pshufb) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)  /* level + 128 unsigned against x, from -128 sum x */
#define LEVEL_OFF 128
#define DOTQ dot4
#else  /* AVX2's vpmaddubsw would saturate on level + 128 (241 127 2): the levels signed, by ggml's sign trick */
#define LEVEL_OFF 0
#define DOTQ dot4s
static inline i32x16 dot4s(i32x16 acc, u8x64 w, const unsigned char* x4) {  /* dot4 with w signed */
  int v; __builtin_memcpy(&v, x4, 4);
  i8x32 xv = (i8x32)(i32x8)v;
  return acc + CAT16(dot32s((i8x32)LO32(w), xv), dot32s((i8x32)HI32(w), xv));
}
#endif
static inline u8x64 levels64(u8x64 nib) {
  u8x16 t = (u8x16)KV4_INT ^ (unsigned char)LEVEL_OFF;  /* + 128 mod 256 where LEVEL_OFF is 128 */
#if defined(__AVX512BW__)
  return (u8x64)__builtin_ia32_pshufb512((v64qi_t)__builtin_shufflevector(t, t, S16(0), S16(0), S16(0), S16(0)),
                                         (v64qi_t)nib);
#elif defined(__AVX2__)
  typedef char v32qi_t __attribute__((vector_size(32)));
  u8x32 t2 = __builtin_shufflevector(t, t, S16(0), S16(0));
  return CAT64((u8x32)__builtin_ia32_pshufb256((v32qi_t)t2, (v32qi_t)LO32(nib)),
               (u8x32)__builtin_ia32_pshufb256((v32qi_t)t2, (v32qi_t)HI32(nib)));
#else
  u8x64 r;
  for (int i = 0; i < 64; i++) r[i] = t[nib[i]];
  return r;
#endif
}
#else
#define DOTQ dot4
#endif
/* a run of 32 values' 4 chunks at p (64 bytes each, 16 rows) as 8 vectors of bytes: q[2c] chunk c's low nibbles,
   q[2c + 1] its high ones, (Q5_0) their fifth bits from hb or-ed in, (IQ4) looked up */
static inline __attribute__((always_inline)) void chunks_at(const unsigned char* p, const unsigned char* hb,
                                                            u8x64* q) {
#if GROUP_FIFTH
  u32x16 h; __builtin_memcpy(&h, hb, 64);
#endif
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
    u8x64 v; __builtin_memcpy(&v, p + 64 * c, 64);
    q[2 * c] = v & 15; q[2 * c + 1] = (u8x64)((u16x32)v >> 4) & 15;  /* x86 shifts 16-bit lanes, not bytes */
#if GROUP_FIFTH
    q[2 * c] |= fifth_bits(h, 2 * c); q[2 * c + 1] |= fifth_bits(h, 2 * c + 1);
#endif
#if GROUP_LEVELS
    q[2 * c] = levels64(q[2 * c]); q[2 * c + 1] = levels64(q[2 * c + 1]);
#endif
  } }
/* a group's block b and what follows it PP_GROUP_AHEAD bytes on, asked for in the first pass of a block of x over it
   (kernels.vendor_choices: Intel's cores, whose prefetch did not keep a group's stream ahead); none elsewhere */
#ifdef PP_GROUP_AHEAD
#define GROUP_ASK(b, ask) do { if (ask) { AHEAD_BY(b, GB, PP_GROUP_AHEAD); } } while (0)
#else
#define GROUP_ASK(b, ask) (void)(ask)
#endif
#if BLOCK_VALUES == 32
#if GROUP_LEVELS
#define GROUP_OFF LEVEL_OFF
#elif IQ_MIN  /* Q4_1, Q5_1: unsigned values, a min m per block (its 16 rows' fp16 after their d) */
#define GROUP_OFF 0
#endif
#if IQ_MIN
enum { G_QH = 64 };  /* where a block's fifth bits start: after the rows' d and m */
#else
enum { G_QH = 32 };
#endif
enum { G_QS = GB - 4 * 64 };  /* where a block's chunks start */
typedef struct { u8x64 q[8]; f16v d, m; } gblock;  /* q[2c] chunk c's low nibbles, q[2c + 1] its high ones */
static inline void gblock_at(const unsigned char* b, gblock* g) {
  h16x16 h; __builtin_memcpy(&h, b, 32);
  g->d = __builtin_convertvector(h, f16v);
#if IQ_MIN
  __builtin_memcpy(&h, b + 32, 32);
  g->m = __builtin_convertvector(h, f16v);
#endif
  chunks_at(b + G_QS, b + G_QH, g->q); }
/* f (a row of x's 16 sums, one a weight row) += block g's products with x's block xb, scaled. chains: the dependent
   sums split in that many (1 or 2: integer sums, the same in any order); one row of x wants two, several rows of x
   are chains enough and keep a register each */
static inline __attribute__((always_inline)) void group_dot(f16v* f, const gblock* g, const unsigned char* xb,
                                                            int chains) {
  short bs[2]; float dx;
  __builtin_memcpy(bs, xb + X_SUMS, 4); __builtin_memcpy(&dx, xb + X_D, 4);
  i32x16 lo = (i32x16)(-GROUP_OFF * (bs[0] + bs[1])), hi = 0;
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
    lo = DOTQ(lo, g->q[2 * c], xb + 8 * c);
    if (chains == 2) hi = DOTQ(hi, g->q[2 * c + 1], xb + 8 * c + 4);
    else lo = DOTQ(lo, g->q[2 * c + 1], xb + 8 * c + 4);
  }
#if IQ_MIN  /* + m dx sum q: x's side from its 16-value sums */
  *f += __builtin_convertvector(lo + hi, f16v) * (g->d * dx) + g->m * (dx * (float)(bs[0] + bs[1]));
#else
  *f += __builtin_convertvector(lo + hi, f16v) * (g->d * dx);
#endif
}
#if !GROUP_LEVELS && defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2, the unsigned 32-value types (Q4_0, Q4_1, Q5_0, Q5_1): as Q4_K's (below), a chunk's pair products (vpmaddubsw)
   added in 16 bits, here over a block's chunks (4 of Q4's values at most 15: 8 2 15 127 < 2^15; 2 of Q5's, at most
   31), then into 32 bits by one vpmaddwd with ones, where dot4 took one a chunk; each chunk unpacked (both 8-row
   halves) just before its products with the rows of x. The same int32 sums: the same floats as the other builds'.
   AVX-512 without VNNI keeps dot4 (its 8 rows of x a pass; these sums not tried there). */
enum { CH16 = GROUP_FIFTH ? 2 : 4 };  /* chunks a 16-bit sum holds */
static inline i32x8 widen16(i16x16 p) { return (i32x8)__builtin_ia32_pmaddwd256(p, (i16x16)(short)1); }
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx, int ask) {
  enum { NB = PP_K / BLOCK_VALUES };
  f8v f[2][GXR];  /* half h's 8 rows' sums, a row of x each */
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[0][i] = f[1][i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    GROUP_ASK(b, ask);
    i32x8 sum[2][GXR];
    i16x16 p[2][GXR];
    _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
      u8x32 lo[2], hi[2];
      _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
        u8x32 v = u8x32_at(b + G_QS + 64 * c + 32 * h);
        lo[h] = v & 15; hi[h] = (u8x32)((u16x16)v >> 4) & 15;
#if GROUP_FIFTH  /* bits 2c, 2c + 1 of each byte of the half's words to bit 4 */
        u8x32 fb = u8x32_at(b + G_QH + 32 * h);
        lo[h] |= field8(fb, 2 * c, 4, 1); hi[h] |= field8(fb, 2 * c + 1, 4, 1);
#endif
      }
      _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
        const unsigned char* xb = xq + ((long)i * NB + j) * XB + 8 * c;
        int x0, x1; __builtin_memcpy(&x0, xb, 4); __builtin_memcpy(&x1, xb + 4, 4);
        _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
          i16x16 t = pairs_u(lo[h], (i8x32)(i32x8)x0) + pairs_u(hi[h], (i8x32)(i32x8)x1);
          p[h][i] = c % CH16 ? p[h][i] + t : t;
          KEEP(p[h][i]);
          if (c % CH16 == CH16 - 1) sum[h][i] = c < CH16 ? widen16(p[h][i]) : sum[h][i] + widen16(p[h][i]);
        }
      }
      IN_ORDER();
    }
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      const unsigned char* xb = xq + ((long)i * NB + j) * XB;
      short bs[2]; float dx;
      __builtin_memcpy(bs, xb + X_SUMS, 4); __builtin_memcpy(&dx, xb + X_D, 4);
      _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
        h16x8 hd; __builtin_memcpy(&hd, b + 16 * h, 16);
        f8v d = __builtin_convertvector(hd, f8v);
        i32x8 s = sum[h][i] + (i32x8)(-GROUP_OFF * (bs[0] + bs[1]));
#if IQ_MIN
        h16x8 hm; __builtin_memcpy(&hm, b + 32 + 16 * h, 16);
        f[h][i] += __builtin_convertvector(s, f8v) * (d * dx)
                 + __builtin_convertvector(hm, f8v) * (dx * (float)(bs[0] + bs[1]));
#else
        f[h][i] += __builtin_convertvector(s, f8v) * (d * dx);
#endif
      }
    }
  }
  for (int i = 0; i < nx; i++)
    for (int h = 0; h < 2; h++) __builtin_memcpy(out + i * stride + 8 * h, &f[h][i], sizeof f[h][i]);
}
#else
/* a group's 16 rows against nx (at most GXR) rows of x: each block unpacked once for all of them */
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx, int ask) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    GROUP_ASK(b, ask);
    gblock g; gblock_at(b, &g);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++)
      if (i < nx) group_dot(&f[i], &g, xq + ((long)i * NB + j) * XB, nx == 1 ? 2 : 1);
  }
  for (int i = 0; i < nx; i++) __builtin_memcpy(out + i * stride, &f[i], sizeof f[i]);
}
#endif
#elif GROUP_LEVELS  /* IQ4_XS */
/* Block j of a group (16 x 136 bytes): the 16 rows' d (fp16), their scales_h (2 bytes a row), their scales_l (4 bytes
   a row), then each of the 8 sub-blocks of 32 values as 4 chunks as IQ4_NL's block. A sub-block's 16 row sums in one
   vector (from -LEVEL_OFF sum x) times its 16 rows' 6-bit scales less 32 (vpmulld), summed over the block in int32
   (|sum| < 2^31: 8 32 127 127 32), then f += float(sum) (d dx) a block, the same steps for any pass: ggml's order. */
enum { XS_SH = 32, XS_SL = 64, XS_QS = 128 };
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx, int ask) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    GROUP_ASK(b, ask);
    u32x16 sl; __builtin_memcpy(&sl, b + XS_SL, 64);
    u16x16 sh16; __builtin_memcpy(&sh16, b + XS_SH, 32);
    u32x16 sh = __builtin_convertvector(sh16, u32x16);
    i32x16 acc[GXR];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) acc[i] = 0;
    _Pragma("clang loop unroll(full)") for (int s = 0; s < 8; s++) {
      u8x64 q[8]; chunks_at(b + XS_QS + 256 * s, 0, q);
      i32x16 ls = (i32x16)(((sl >> 4 * s) & 15) | ((sh >> 2 * s) & 3) << 4) - 32;
      _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
        const unsigned char* xb = xq + ((long)i * NB + j) * XB;
        short bs[2]; __builtin_memcpy(bs, xb + X_SUMS + 4 * s, 4);
        i32x16 lo = (i32x16)(-LEVEL_OFF * (bs[0] + bs[1])), hi = 0;
        _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
          lo = DOTQ(lo, q[2 * c], xb + 32 * s + 8 * c); hi = DOTQ(hi, q[2 * c + 1], xb + 32 * s + 8 * c + 4); }
        acc[i] += (lo + hi) * ls;
      }
    }
    h16x16 hd; __builtin_memcpy(&hd, b, 32);
    f16v d = __builtin_convertvector(hd, f16v);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      float dx; __builtin_memcpy(&dx, xq + ((long)i * NB + j) * XB + X_D, 4);
      f[i] += __builtin_convertvector(acc[i], f16v) * (d * dx);
    }
  }
  for (int i = 0; i < nx; i++) __builtin_memcpy(out + i * stride, &f[i], sizeof f[i]);
}
#else  /* the 256-value K-quants: Q2_K (GROUP_K 2), Q3_K (GROUP_K 3), Q4_K (GROUP_K 4), Q6_K (GROUP_K 6) */
/* Their values' low bits are the file's words of qs (ql), a group's block holding each word m as 16 rows' words side
   by side (a chunk of 64 bytes, a transpose of 32-bit words at load), after the type's scales, so 4 values of each row
   a chunk go against x's 4 values broadcast (vpdpbusd, as the 32-value types'): a sub-block's sums of the 16 rows lie
   in one vector. A pass takes a pair of sub-blocks (p: values 2 K_SUB p ..): their two sums times their scales, the
   mins (Q2_K, Q4_K) or the scales (Q3_K, Q6_K, whose values are u - 4 and u - 32: their min is 4 s, 32 s) against
   x's sums the same way. Per (row, x) and block: f += float(sum) (d dx) - float(mins) (dmin dx) (Q3_K: float(sum -
   4 mins) (d dx), Q6_K: 32 mins), the same steps for any pass.
   - Q2_K (16 x 84 bytes): two halves h, each for its pairs p = 4h..4h + 3 of sub-blocks of 16 values (2p, 2p + 1)
     the 16 rows' 2 scale bytes (a row's bytes 2r, 2r + 1: the scale in the low nibble, the min in the high one),
     then its 8 qs chunks (words m = 8h..8h + 7); then the 16 rows' d, then their dmin (fp16). Word m's bit pair i
     holds values 128 (m / 8) + 32i + 4 (m % 8) + t (t = 0..3, the byte). So a block is read in the order it lies:
     with d, dmin and all 8 pairs' scales first its first line was read last and the scales' lines between the
     chunks' (one thread 1.1x cache-hot and from DRAM; bench/NOTES.md).
     For one row of x a chunk's bit pair k is taken in place (and-ed, 4^k times the value; `K2_AT`), its sums shifted
     back before the scales (one and a chunk instead of a shift and an and).
   - Q3_K (16 x 110 bytes): the 16 rows' d; the file's 12 scale bytes as 6 pairs (bytes 2q, 2q + 1), each the 16 rows'
     side by side; then for each pair p a triple of chunks a, e, c: the pair's 32 values of each row as 3-bit u (ggml's
     q + 4; hmask and qs rewritten at load, the same 96 bytes a row), byte t of a row's words holding values 4v + t
     of sub-block 2p (u0) and 2p + 1 (u1): a u0 and u1 of v = 0 at bits 0-2 and 3-5, e those of v = 1, c those of v =
     2; u0 of v = 3 from a's bits 6-7 and c's bit 6, u1 of v = 3 from e's bits 6-7 and c's bit 7. So 6 of a pair's 8
     vectors of values are one and each (u1 8 times its value, in place), the other 2 two picks and an or, where the
     file's layout took a shift, an and, a pick and an or each with its hmask chunk read again every pass
     (`gguf.tensors._q3_k_triples`).
   - Q4_K (16 x 144 bytes): the 16 rows' d, dmin; the 12 scale bytes as 3 words (chunks); then the 32 qs chunks: word
     m's low nibbles values 64 (m / 8) + 4 (m % 8) + t (sub-block 2 (m / 8) of 32 values), its high ones 32 more.
   - Q6_K (16 x 210 bytes): the 16 scale bytes (int8) as 4 words; then for each sub-block s (16 values) a triple of
     chunks a, e, c: its values as 6-bit u (ggml's q + 32; ql and qh rewritten at load, the same 192 bytes a row),
     byte t of a row's words holding u of value 16s + 4v + t at bits 0-5, a of v = 0, e of v = 1, c of v = 2, and u
     of v = 3 in their bits 6-7 (a its bits 0-1, e 2-3, c 4-5). So 3 of a sub-block's 4 vectors are one and each, the
     fourth 3 picks and an or (by shifts at several rows of x: GFNI shares vpdpbusd's pipes), where the file's layout
     took two loads, a shift or two, two ands and an or each: a block 489 -> 437 instructions at one row of x
     (`gguf.tensors._q6_k_triples`); then the 16 rows' d (last: a block's chunks start at a cache line, 1.1x from
     DRAM against d first).
   Q2_K's and Q3_K's pair sums fit 16 bits (|t| <= 16 7 127): side by side as 16-bit halves times the scales in one
   vpdpwssd; Q4_K's and Q6_K's (32 15 127, 16 63 127) do not: times their scales in 32 bits (vpmulld).
   From memory the order of the loads counts: left to the compiler, a block's loads of Q6_K (whose pairs were all
   unrolled) went out in an order the hardware's prefetch did not follow, 8.5 GB/s against the plain rows' 23 (one
   thread); IN_ORDER after each chunk and pass makes them go out as the block lies: Q6_K 1.3x the plain rows, Q4_K
   1.15x its groups without it, Q2_K 1.0-1.1x; Q3_K's triples are read once each, in order (bench/NOTES.md). */
/* K_QS: where the values start; K_D: where the 16 rows' d lie (Q2_K's, Q4_K's dmin after them) */
#if GROUP_K == 2  /* half h (K2_HALF bytes): pairs 4h..4h + 3's scales, then their 8 chunks; then d, dmin */
enum { K2_HALF = 4 * 32 + 8 * 64, K_QS = 4 * 32, K_D = 2 * K2_HALF };
#elif GROUP_K == 3  /* then a triple of chunks a pair of sub-blocks */
enum { K3_SA = 32, K3_SB = 32 + 4 * 32, K_QS = 32 + 6 * 32, K_D = 0 };
#elif GROUP_K == 4
enum { K4_SC = 64, K_QS = K4_SC + 3 * 64, K_D = 0 };
#else
enum { K_QS = 4 * 64, K_D = GB - 32 };  /* after the scales: a triple of chunks a sub-block; d last */
#endif
#if GROUP_K == 4
enum { K_SUB = 32 };  /* values a sub-block */
#else
enum { K_SUB = 16 };
#endif
enum { K_CH = K_SUB / 4, K_PAIRS = 128 / K_SUB };  /* chunks a sub-block, pairs of sub-blocks a block */
_Static_assert(K_QS + (GROUP_K == 6 ? 48 * 64 + 32 : GROUP_K == 4 ? 32 * 64 : GROUP_K == 3 ? 24 * 64
                       : 4 * 32 + 16 * 64 + 64) == GB, "a group's block");
/* acc + a's and b's 16-bit pairs multiplied and summed into each 32-bit lane (vpdpwssd) */
static inline i32x16 madd_pairs16(i32x16 acc, i16x32 a, i16x32 b) {
#if defined(__AVX512BW__)
  return madd32_acc(acc, a, b);
#else
  return acc + CAT16(madd16(__builtin_shufflevector(a, a, S16(0)), __builtin_shufflevector(b, b, S16(0))),
                     madd16(__builtin_shufflevector(a, a, S16(16)), __builtin_shufflevector(b, b, S16(16))));
#endif
}
static inline i16x32 i16_pairs(const unsigned char* p) { return __builtin_convertvector(u8x32_at(p), i16x32); }
static inline u32x16 u32x16_at(const unsigned char* p) { u32x16 v; __builtin_memcpy(&v, p, 64); return v; }
/* two 32-bit lanes' low halves side by side as 16-bit pairs (a row's pair of scales or sums) */
static inline i16x32 halves(u32x16 a, u32x16 b) { return (i16x32)((a & 0xFFFF) | (b << 16)); }
/* the same of a / 2^sa and b / 2^sb, sums of values taken in place (2^s times theirs: their low s bits 0) */
static inline i16x32 halves_at(i32x16 a, int sa, i32x16 b, int sb) {
  return (i16x32)((((u32x16)a >> sa) & 0xFFFF) | ((u32x16)b << (16 - sb))); }
/* where a Q2_K bit pair at bit 2k is taken for one row of x: in place (2^2k times the value: one and a chunk, its sums
   shifted back), but at most bit 4 where the dot adds pairs of products in 16 bits (AVX2's vpmaddubsw: 192 127 2 would
   saturate). Several rows of x take it at bit 0: each would shift its sums back, where the shift of a chunk is shared
   (in place there: 0.95x at 64 rows of x) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define K2_AT(k) (2 * (k))
#else
#define K2_AT(k) (2 * (k) < 4 ? 2 * (k) : 4)
#endif
/* a pair of sub-blocks of the 16 rows: q (sub-block 2p's K_CH chunks of values, then 2p + 1's), their scales as
   16-bit pairs (sc: Q2_K, Q3_K) or each in 32 bits (sa, sb: Q4_K, Q6_K), and their mins (m) as 16-bit pairs */
typedef struct { u8x64 q[2 * K_CH]; i16x32 sc, m; i32x16 sa, sb; } kpair;
#if GROUP_K == 4
/* sub-block j's 6-bit scale and min (ggml's get_scale_min_k4) from the 12 scale bytes as 3 words of the 16 rows */
static inline void k4_scale(const u32x16* w, int j, u32x16* s, u32x16* m) {
  if (j < 4) { *s = (w[0] >> 8 * j) & 63; *m = (w[1] >> 8 * j) & 63; return; }
  int i = 8 * (j - 4);
  *s = ((w[2] >> i) & 15) | ((w[0] >> (i + 6)) & 3) << 4;
  *m = ((w[2] >> (i + 4)) & 15) | ((w[1] >> (i + 6)) & 3) << 4;
}
#elif GROUP_K == 6
static inline i32x16 k6_scale(u32x16 w, int k) { return (i32x16)(w << (24 - 8 * k)) >> 24; }  /* byte k, signed */
#endif
/* where Q2_K's bit pairs of pair p are taken (K2_AT) for nx rows of x: in place for one row only (see above) */
static inline int k2_at(int p, int nx) { return nx == 1 ? K2_AT(p % 4) : 0; }
/* pair p's values and scales for nx rows of x */
static inline __attribute__((always_inline)) void k_pair(const unsigned char* b, int p, int nx, kpair* kp) {
#if GROUP_K == 2
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 8; c++) {
    u8x64 v; __builtin_memcpy(&v, b + K2_HALF * (p / 4) + K_QS + 64 * c, 64);
    kp->q[c] = bits64(v, 2 * (p % 4), k2_at(p, nx), 2);
    IN_ORDER();
  }
#elif GROUP_K == 3  /* the pair's triple a, e, c: 6 vectors in place by one and each, 2 of two pieces */
  const unsigned char* t = b + K_QS + 192 * p;
  u8x64 a, e, c;
  __builtin_memcpy(&a, t, 64); IN_ORDER(); __builtin_memcpy(&e, t + 64, 64); IN_ORDER();
  __builtin_memcpy(&c, t + 128, 64); IN_ORDER();
  kp->q[0] = a & 7; kp->q[1] = e & 7; kp->q[2] = c & 7; kp->q[3] = pick64(a, 6, 0, 2) | pick64(c, 6, 2, 1);
  kp->q[4] = a & 0x38; kp->q[5] = e & 0x38; kp->q[6] = c & 0x38; kp->q[7] = pick64(e, 6, 3, 2) | pick64(c, 7, 5, 1);
#endif
#if GROUP_K == 2
  i16x32 sm = i16_pairs(b + K2_HALF * (p / 4) + 32 * (p % 4));
  kp->sc = sm & 15; kp->m = sm >> 4;
#elif GROUP_K == 3  /* scale j = 2p, 2p + 1: its low 4 bits nibble j / 8 of byte j % 8, its high 2 bits bits 2 (j / 4)
   of byte 8 + j % 4, minus 32 */
  i16x32 lo = i16_pairs(b + K3_SA + 32 * (p % 4)), hi = i16_pairs(b + K3_SB + 32 * (p % 2));
  kp->sc = kp->m = ((p < 4 ? lo & 15 : lo >> 4) | ((hi >> 2 * (p / 2)) & 3) << 4) - 32;
#elif GROUP_K == 4
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 8; c++) {
    u8x64 v; __builtin_memcpy(&v, b + K_QS + 64 * (8 * p + c), 64);
    kp->q[c] = v & 15; kp->q[8 + c] = (u8x64)((u16x32)v >> 4) & 15;
    IN_ORDER();
  }
  u32x16 w[3] = {u32x16_at(b + K4_SC), u32x16_at(b + K4_SC + 64), u32x16_at(b + K4_SC + 128)}, sa, sb, ma, mb;
  k4_scale(w, 2 * p, &sa, &ma); k4_scale(w, 2 * p + 1, &sb, &mb);
  kp->sa = (i32x16)sa; kp->sb = (i32x16)sb; kp->m = halves(ma, mb);
#else  /* sub-blocks 2p, 2p + 1: a triple a, e, c each, 3 vectors by one and, the fourth gathered from their tops */
  _Pragma("clang loop unroll(full)") for (int s = 0; s < 2; s++) {
    const unsigned char* t = b + K_QS + 192 * (2 * p + s);
    u8x64 a, e, c;
    __builtin_memcpy(&a, t, 64); IN_ORDER(); __builtin_memcpy(&e, t + 64, 64); IN_ORDER();
    __builtin_memcpy(&c, t + 128, 64); IN_ORDER();
    kp->q[4 * s] = a & 63; kp->q[4 * s + 1] = e & 63; kp->q[4 * s + 2] = c & 63;
    kp->q[4 * s + 3] = nx == 1 ? pick64(a, 6, 0, 2) | pick64(e, 6, 2, 2) | pick64(c, 6, 4, 2)
                               : bits64(a, 6, 0, 2) | bits64(e, 6, 2, 2) | bits64(c, 6, 4, 2);
  }
  u32x16 w = u32x16_at(b + 64 * (p / 2));
  kp->sa = k6_scale(w, 2 * (p % 2)); kp->sb = k6_scale(w, 2 * (p % 2) + 1);
  kp->m = halves((u32x16)kp->sa, (u32x16)kp->sb);
#endif
}
/* pair p of block b's 16 rows against nx rows of x (block j of theirs): acc += the pair's sums times its scales,
   mn += its mins (Q3_K, Q6_K: scales) times x's sums of the sub-blocks */
static inline __attribute__((always_inline)) void k_pass(const unsigned char* b, int p, const unsigned char* xq,
                                                         int j, int nx, i32x16* acc, i32x16* mn) {
  enum { NB = PP_K / BLOCK_VALUES };
  kpair kp;
  const int at2 = k2_at(p, nx);
  k_pair(b, p, nx, &kp);
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
    const unsigned char* xb = xq + ((long)i * NB + j) * XB;
    const unsigned char* xv = xb + 2 * K_SUB * p;
    i32x16 t0 = 0, t1 = 0;
    _Pragma("clang loop unroll(full)") for (int c = 0; c < K_CH; c++) {
      t0 = dot4(t0, kp.q[c], xv + 4 * c); t1 = dot4(t1, kp.q[K_CH + c], xv + K_SUB + 4 * c); }
#if GROUP_K <= 3  /* Q2_K's values 2^K2_AT times theirs, Q3_K's second sub-block's 8 times */
    acc[i] = madd_pairs16(acc[i], GROUP_K == 2 ? halves_at(t0, at2, t1, at2) : halves_at(t0, 0, t1, 3),
                          kp.sc);
    int bs; __builtin_memcpy(&bs, xb + X_SUMS + 4 * p, 4);
#else
    acc[i] += t0 * kp.sa + t1 * kp.sb;
#if GROUP_K == 4  /* x's sums of 32 values: two of its sums of 16 each */
    short s4[4]; __builtin_memcpy(s4, xb + X_SUMS + 8 * p, 8);
    int bs = (unsigned short)(s4[0] + s4[1]) | (unsigned)(s4[2] + s4[3]) << 16;  /* |sum| <= 32 127 */
#else
    int bs; __builtin_memcpy(&bs, xb + X_SUMS + 4 * p, 4);
#endif
#endif
    mn[i] = madd_pairs16(mn[i], kp.m, (i16x32)(i32x16)bs);
  }
}
#if GROUP_K == 3
#define K_OFF 4  /* the values' offset, times the scales: Q3_K's u - 4, Q6_K's u - 32 */
#elif GROUP_K == 6
#define K_OFF 32
#endif
#if GROUP_K == 4 && defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* Q4_K with AVX2 and no vpdpbusd (16 ymm registers; AVX-512 without VNNI takes the same steps). A chunk's two
   sub-blocks' products with x (vpmaddubsw: each 16-bit lane a pair of products) are added in 16 bits over the pair's
   8 chunks (8 2 15 127 < 2^15), then times their scales, the scale in both halves of a 32-bit lane, and summed into
   32 bits by one vpmaddwd: 2 instructions a chunk, row of x and 8 weight rows, where dot4 took 3 and a vpmulld each
   sub-block. A chunk is unpacked, both of its 8-row
   halves, just before its products with the GXR rows of x (the pair's 16 unpacked chunks, 32 registers, spilled
   first: 0.72-0.83x the plain rows at 64 rows of x); each x broadcast serves both halves (two rows of x: 1.1-1.3x one
   half against four rows, whose broadcasts took the loads' ports; bench/NOTES.md). KEEP holds each 16-bit sum one
   chain (clang split them in two, 16 registers of sums, and spilled). The same int32 sums, so the same floats as the
   other builds' passes. */
static inline i16x16 half16(i16x32 v, int h) {  /* lanes 16h..16h + 15 */
  return h ? __builtin_shufflevector(v, v, S16(16)) : __builtin_shufflevector(v, v, S16(0)); }
/* half h's 8 lanes of s (< 2^16) in both 16-bit halves of each (a shift and an or: clang wrote them as vpmulld) */
static inline i16x16 twice16(u32x16 s, int h) {
  u32x8 v = h ? HI8(s) : LO8(s), t = v << 16;
  KEEP(t);
  return (i16x16)(v | t); }
/* a block's scales as its passes take them, pair p's for half h: sub-block 2p's and 2p + 1's in both 16-bit halves
   of a lane, their mins side by side */
typedef struct { i16x16 sa, sb, m; } k4scales;
static inline __attribute__((always_inline)) void k4_scales(const unsigned char* b, k4scales (*sc)[2]) {
  const u32x16 w[3] = {u32x16_at(b + K4_SC), u32x16_at(b + K4_SC + 64), u32x16_at(b + K4_SC + 128)};
  _Pragma("clang loop unroll(full)") for (int p = 0; p < K_PAIRS; p++) {
    u32x16 sa, sb, ma, mb;
    k4_scale(w, 2 * p, &sa, &ma); k4_scale(w, 2 * p + 1, &sb, &mb);
    i16x32 m2 = halves(ma, mb);
    _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++)
      sc[p][h] = (k4scales){twice16(sa, h), twice16(sb, h), half16(m2, h)};
  }
}
/* block b of the group (j of x's, its scales sc) against nx (at most GXR) rows of x: f[i][h] += its products, half
   h's rows */
static inline __attribute__((always_inline)) void k4_block(f8v (*f)[2], const unsigned char* b,
                                                           const k4scales (*sc)[2], const unsigned char* restrict xq,
                                                           int j, int nx) {
  enum { NB = PP_K / BLOCK_VALUES };
  i32x8 acc[2][GXR], mn[2][GXR];
  _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) acc[h][i] = mn[h][i] = 0;
  _Pragma("clang loop unroll(full)") for (int p = 0; p < K_PAIRS; p++) {
    i16x16 p0[2][GXR], p1[2][GXR];  /* sub-block 2p's 16-bit sums, 2p + 1's */
    _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++)
      _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) p0[h][i] = p1[h][i] = 0;
    _Pragma("clang loop unroll(full)") for (int c = 0; c < 8; c++) {
      u8x32 lo[2], hi[2];
      _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
        u8x32 v = u8x32_at(b + K_QS + 64 * (8 * p + c) + 32 * h);
        lo[h] = v & 15; hi[h] = (u8x32)((u16x16)v >> 4) & 15;
      }
      _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
        const unsigned char* xv = xq + ((long)i * NB + j) * XB + 2 * K_SUB * p + 4 * c;
        int x0, x1; __builtin_memcpy(&x0, xv, 4); __builtin_memcpy(&x1, xv + K_SUB, 4);
        _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
          p0[h][i] += pairs_u(lo[h], (i8x32)(i32x8)x0); p1[h][i] += pairs_u(hi[h], (i8x32)(i32x8)x1);
          KEEP(p0[h][i]); KEEP(p1[h][i]);
        }
      }
      IN_ORDER();
    }
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      short s4[4]; __builtin_memcpy(s4, xq + ((long)i * NB + j) * XB + X_SUMS + 8 * p, 8);
      int bs = (unsigned short)(s4[0] + s4[1]) | (unsigned)(s4[2] + s4[3]) << 16;  /* |sum| <= 32 127 */
      _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
        acc[h][i] = madd16_acc(madd16_acc(acc[h][i], p0[h][i], sc[p][h].sa), p1[h][i], sc[p][h].sb);
        mn[h][i] = madd16_acc(mn[h][i], sc[p][h].m, (i16x16)(i32x8)bs);
      }
    }
  }
  _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
    h16x8 hd, hm; __builtin_memcpy(&hd, b + K_D + 16 * h, 16); __builtin_memcpy(&hm, b + K_D + 32 + 16 * h, 16);
    f8v d = __builtin_convertvector(hd, f8v), dm = __builtin_convertvector(hm, f8v);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      float dx; __builtin_memcpy(&dx, xq + ((long)i * NB + j) * XB + X_D, 4);
      f[i][h] += __builtin_convertvector(acc[h][i], f8v) * (d * dx)
               - __builtin_convertvector(mn[h][i], f8v) * (dm * dx);
    }
  }
}
/* the group's 16 rows against a block of x's nx rows (at most XBLOCK): each block of the group's scales decoded once,
   then passed by the rows of x GXR at a time while it lies in the L1 (a pass decoding them took ~15% of it: 1.15x),
   their sums in f */
#define GROUP_WHOLE_BLOCK 1
static inline __attribute__((always_inline)) void group_block(float* restrict out, long stride,
                                                              const unsigned char* restrict gw,
                                                              const unsigned char* restrict xq, int nx) {
  enum { NB = PP_K / BLOCK_VALUES };
  f8v f[XBLOCK][2];  /* row i of x's sums, half h's rows */
  for (int i = 0; i < nx; i++) f[i][0] = f[i][1] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    GROUP_ASK(b, 1);
    k4scales sc[K_PAIRS][2];
    k4_scales(b, sc);
    int i = 0;
    for (; i + GXR <= nx; i += GXR) k4_block(f + i, b, sc, xq + (long)i * NB * XB, j, GXR);
    for (; i < nx; i++) k4_block(f + i, b, sc, xq + (long)i * NB * XB, j, 1);
  }
  for (int i = 0; i < nx; i++)
    for (int h = 0; h < 2; h++) __builtin_memcpy(out + i * stride + 8 * h, &f[i][h], sizeof f[i][h]);
}
#else
/* a group's 16 rows against nx (at most GXR) rows of x: each pair of sub-blocks unpacked once for all of them */
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx, int ask) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    GROUP_ASK(b, ask);
    i32x16 acc[GXR], mn[GXR];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) acc[i] = mn[i] = 0;
    /* the 8 pairs unrolled whole (Q3_K's file layout spilled so at several rows of x and took two pairs a step; its
       triples do not: 0.99-1.04x the two a step) */
    _Pragma("clang loop unroll(full)") for (int p = 0; p < K_PAIRS; p++) {
      k_pass(b, p, xq, j, nx, acc, mn);
      IN_ORDER();
    }
    h16x16 hd; __builtin_memcpy(&hd, b + K_D, 32);
    f16v d = __builtin_convertvector(hd, f16v);
#ifndef K_OFF
    h16x16 hm; __builtin_memcpy(&hm, b + K_D + 32, 32);
    f16v dm = __builtin_convertvector(hm, f16v);
#endif
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      float dx; __builtin_memcpy(&dx, xq + ((long)i * NB + j) * XB + X_D, 4);
#ifndef K_OFF
      f[i] += __builtin_convertvector(acc[i], f16v) * (d * dx) - __builtin_convertvector(mn[i], f16v) * (dm * dx);
#else
      f[i] += __builtin_convertvector(acc[i] - K_OFF * mn[i], f16v) * (d * dx);
#endif
    }
  }
  for (int i = 0; i < nx; i++) __builtin_memcpy(out + i * stride, &f[i], sizeof f[i]);
}
#endif
#endif
void NAME(float* restrict out, const unsigned char* restrict w, const unsigned char* restrict xq,
          const int* restrict dims, int core_id) {
  enum { K = PP_K, R = PP_ROWS, NB = K / BLOCK_VALUES };
  _Static_assert(PP_ROWS % GR == 0, "parts must start at a group");
  const int N = dims[0], B = dims[1], T = dims[2], NG = N / GR * GR;
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  int g1 = n1 < NG ? n1 : NG;
  for (int c0 = 0; c0 < B; c0 += XBLOCK) {  /* a block of x stays in L2 while every group passes it */
    int c1 = c0 + XBLOCK < B ? c0 + XBLOCK : B;
    for (int n = n0; n < g1; n += GR) {
      const unsigned char* gw = w + (long)n * NB * BLOCK_BYTES;
#ifdef GROUP_WHOLE_BLOCK
      group_block(out + (long)c0 * N + n, N, gw, xq + (long)c0 * NB * XB, c1 - c0);
#else
      for (int b0 = c0; b0 < c1; b0 += GXR) {
        int nx = c1 - b0;
        float* o = out + (long)b0 * N + n; const unsigned char* x = xq + (long)b0 * NB * XB;
        const int ask = b0 == c0;  /* the block's first pass reads the group from memory; the others, from cache */
        if (nx >= GXR) group_rows(o, N, gw, x, GXR, ask);  /* constants: the loops without their guards */
        else if (nx == 1) group_rows(o, N, gw, x, 1, ask);
        else group_rows(o, N, gw, x, nx, ask);
      }
#endif
    }
    for (int n = n0 > NG ? n0 : NG; n < n1; n++) rows_pass(out, w + (long)n * NB * BLOCK_BYTES, xq, N, n, c0, c1);
  }
}
