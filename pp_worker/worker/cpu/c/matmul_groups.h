/* The integer path's product (matmul_int.c's NAME) for weights whose rows `gguf.tensors.grouped` interleaved at load,
   PP_GROUP (16) rows a group, a row a 32-bit lane: 32-value blocks (Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1), IQ4_XS and the
   K-quants of bit pairs (Q2_K, Q3_K: GROUP_K; below). The rows past the last whole group stay plain, after the groups
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
/* acc + each lane's 4 bytes of w times the 4 bytes at x4 (int8) */
static inline i32x16 dot4(i32x16 acc, u8x64 w, const unsigned char* x4) {
  int v; __builtin_memcpy(&v, x4, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (i32x16)__builtin_ia32_vpdpbusd512(acc, (i32x16)w, (i32x16)v);  /* the broadcast folds into its operand */
#else
  i8x32 xv = (i8x32)(i32x8)v;  /* q <= 31: AVX2's 16-bit pair sums cannot saturate */
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
/* a group's 16 rows against nx (at most GXR) rows of x: each block unpacked once for all of them */
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    gblock g; gblock_at(b, &g);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++)
      if (i < nx) group_dot(&f[i], &g, xq + ((long)i * NB + j) * XB, nx == 1 ? 2 : 1);
  }
  for (int i = 0; i < nx; i++) __builtin_memcpy(out + i * stride, &f[i], sizeof f[i]);
}
#elif GROUP_LEVELS  /* IQ4_XS */
/* Block j of a group (16 x 136 bytes): the 16 rows' d (fp16), their scales_h (2 bytes a row), their scales_l (4 bytes
   a row), then each of the 8 sub-blocks of 32 values as 4 chunks as IQ4_NL's block. A sub-block's 16 row sums in one
   vector (from -LEVEL_OFF sum x) times its 16 rows' 6-bit scales less 32 (vpmulld), summed over the block in int32
   (|sum| < 2^31: 8 32 127 127 32), then f += float(sum) (d dx) a block, the same steps for any pass: ggml's order. */
enum { XS_SH = 32, XS_SL = 64, XS_QS = 128 };
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
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
#else  /* the 256-value K-quants of 2-bit pairs: Q2_K (GROUP_K 2), Q3_K (GROUP_K 3) */
/* Their values are bit pairs of qs as Q2_K's: the file's 4 bytes m of qs (0..15) hold in bit pair i values 128 (m / 8)
   + 32i + 4 (m % 8) + t (t = 0..3, the byte); a group's block holds each m as 16 rows' words side by side (a chunk of
   64 bytes, a transpose of 32-bit words at load), after the type's scales:
   - Q2_K (16 x 84 bytes): the 16 rows' d, then their dmin (fp16); then for each pair p of sub-blocks of 16 values
     (2p, 2p + 1) the 16 rows' 2 scale bytes (a row's bytes 2r, 2r + 1: the scale in the low nibble, the min in the
     high one); then the 16 qs chunks.
   - Q3_K (16 x 110 bytes): the 16 rows' d; the file's 12 scale bytes as 6 pairs (bytes 2q, 2q + 1), each the 16 rows'
     side by side; the file's 4 bytes c of hmask (0..7) as 8 chunks as qs's (value l's third bit is bit l / 32 of
     hmask byte l % 32); then the 16 qs chunks.
   Pair p of sub-blocks (half h = p / 4, bit pair i = p % 4; 32-value group p) is bit pair i of the half's 8 chunks, 4
   values of each row a chunk against x's 4 values broadcast (vpdpbusd, as the 32-value types'), so a sub-block's sums
   of the 16 rows lie in one vector; the pair's two sums side by side as 16-bit halves (|t| <= 16 7 127 fits) times its
   scales, widened to 16 bits, in one vpdpwssd; the mins (Q2_K) or the scales (Q3_K, whose values are u - 4: its min is
   4 s) the same way against x's two 16-value sums. Per (row, x) and block: f += float(sum) (d dx) - float(mins)
   (dmin dx) (Q3_K: float(sum - 4 mins) (d dx)), the same steps for any pass. */
#if GROUP_K == 2
enum { K_QS = 64 + 8 * 32 };
#else
enum { K3_SA = 32, K3_SB = 32 + 4 * 32, K3_HM = 32 + 6 * 32, K_QS = K3_HM + 8 * 64 };
#endif
_Static_assert(K_QS + 16 * 64 == GB, "a group's block");
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
/* pair p's weights (q: sub-block 2p's 4 chunks of values, then 2p + 1's), their scales (sc) and mins (m) as 16-bit
   pairs of the 16 rows */
static inline __attribute__((always_inline)) void k_pair(const unsigned char* b, int p, u8x64* q, i16x32* sc,
                                                         i16x32* m) {
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 8; c++) {
    u8x64 v; __builtin_memcpy(&v, b + K_QS + 64 * (8 * (p / 4) + c), 64);
    q[c] = bits64(v, 2 * (p % 4), 0, 2);
#if GROUP_K == 3  /* the third bit (bit p of the hmask bytes) at bit 2 */
    u8x64 h; __builtin_memcpy(&h, b + K3_HM + 64 * c, 64);
    q[c] |= pick64(h, p, 2, 1);
#endif
  }
#if GROUP_K == 2
  i16x32 sm = i16_pairs(b + 64 + 32 * p);
  *sc = sm & 15; *m = sm >> 4;
#else  /* scale j = 2p, 2p + 1: its low 4 bits nibble j / 8 of byte j % 8, its high 2 bits bits 2 (j / 4) of byte
   8 + j % 4, minus 32 */
  i16x32 lo = i16_pairs(b + K3_SA + 32 * (p % 4)), hi = i16_pairs(b + K3_SB + 32 * (p % 2));
  *sc = *m = ((p < 4 ? lo & 15 : lo >> 4) | ((hi >> 2 * (p / 2)) & 3) << 4) - 32;
#endif
}
/* pair p of block b's 16 rows against nx rows of x (block j of theirs): acc += the pair's sums times its scales,
   mn += its mins (Q3_K: scales) times x's sums */
static inline __attribute__((always_inline)) void k_pass(const unsigned char* b, int p, const unsigned char* xq,
                                                         int j, int nx, i32x16* acc, i32x16* mn) {
  enum { NB = PP_K / BLOCK_VALUES };
  u8x64 q[8]; i16x32 sc, m;
  k_pair(b, p, q, &sc, &m);
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
    const unsigned char* xb = xq + ((long)i * NB + j) * XB + 32 * p;
    i32x16 t0 = 0, t1 = 0;
    _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
      t0 = dot4(t0, q[c], xb + 4 * c); t1 = dot4(t1, q[4 + c], xb + 16 + 4 * c); }
    int bs; __builtin_memcpy(&bs, xq + ((long)i * NB + j) * XB + X_SUMS + 4 * p, 4);
    acc[i] = madd_pairs16(acc[i], (i16x32)(((u32x16)t0 & 0xFFFF) | ((u32x16)t1 << 16)), sc);
    mn[i] = madd_pairs16(mn[i], m, (i16x32)(i32x16)bs);
  }
}
/* a group's 16 rows against nx (at most GXR) rows of x: each pair of sub-blocks unpacked once for all of them */
static inline __attribute__((always_inline)) void group_rows(float* restrict out, long stride,
                                                             const unsigned char* restrict gw,
                                                             const unsigned char* restrict xq, int nx) {
  enum { NB = PP_K / BLOCK_VALUES };
  f16v f[GXR];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) f[i] = 0;
  for (int j = 0; j < NB; j++) {
    const unsigned char* b = gw + (long)j * GB;
    i32x16 acc[GXR], mn[GXR];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) acc[i] = mn[i] = 0;
    if (GROUP_K == 3 && nx > 1) {  /* Q3_K's passes of several rows of x, the 8 pairs unrolled whole, spilled: two
      pairs a step measured 1.15-1.25x (one row of x and Q2_K's passes 0.86-1.0x) */
      _Pragma("clang loop unroll_count(2)") for (int p = 0; p < 8; p++) k_pass(b, p, xq, j, nx, acc, mn);
    } else {
      _Pragma("clang loop unroll(full)") for (int p = 0; p < 8; p++) k_pass(b, p, xq, j, nx, acc, mn);
    }
    h16x16 hd; __builtin_memcpy(&hd, b, 32);
    f16v d = __builtin_convertvector(hd, f16v);
#if GROUP_K == 2
    h16x16 hm; __builtin_memcpy(&hm, b + 32, 32);
    f16v dm = __builtin_convertvector(hm, f16v);
#endif
    _Pragma("clang loop unroll(full)") for (int i = 0; i < GXR; i++) if (i < nx) {
      float dx; __builtin_memcpy(&dx, xq + ((long)i * NB + j) * XB + X_D, 4);
#if GROUP_K == 2
      f[i] += __builtin_convertvector(acc[i], f16v) * (d * dx) - __builtin_convertvector(mn[i], f16v) * (dm * dx);
#else
      f[i] += __builtin_convertvector(acc[i] - 4 * mn[i], f16v) * (d * dx);
#endif
    }
  }
  for (int i = 0; i < nx; i++) __builtin_memcpy(out + i * stride, &f[i], sizeof f[i]);
}
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
      for (int b0 = c0; b0 < c1; b0 += GXR) {
        int nx = c1 - b0;
        float* o = out + (long)b0 * N + n; const unsigned char* x = xq + (long)b0 * NB * XB;
        if (nx >= GXR) group_rows(o, N, gw, x, GXR);  /* constants: the loops without their guards */
        else if (nx == 1) group_rows(o, N, gw, x, 1);
        else group_rows(o, N, gw, x, nx);
      }
    }
    for (int n = n0 > NG ? n0 : NG; n < n1; n++) rows_pass(out, w + (long)n * NB * BLOCK_BYTES, xq, N, n, c0, c1);
  }
}
