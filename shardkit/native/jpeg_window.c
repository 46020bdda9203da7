/* shardkit's crop-window JPEG decoder: decode only the rows and columns a crop keeps, with exactly the pixels of a
   full decode (nbs/22_jpeg.ipynb explains it); and a crop decoded, resized and flipped in one pass (sk_decode_crop),
   optionally from a DCT-scaled decode (M/8), written straight into its place in a batch. Built at install time as the optional extension
   shardkit.native._jpeg_window (setup.py), else at first use into $SHARDKIT_HOME/native; loaded with ctypes by
   shardkit.loading.jpeg, which calls the two exported functions. Needs libjpeg-turbo 1.5 or newer (jpeg_crop_scanline,
   jpeg_skip_scanlines). */
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <setjmp.h>
#include <stddef.h>
#include <jpeglib.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__GNUC__) && defined(__x86_64__) && !defined(SK_NO_AVX2)
#include <immintrin.h>
#define SK_AVX2 1  /* compiled for any x86-64; the AVX2 path is taken where the CPU has it (-DSK_NO_AVX2: never) */
#endif

#if JPEG_LIB_VERSION >= 70
#define SK_MIN_DCT(c) ((c)->min_DCT_h_scaled_size)
#else
#define SK_MIN_DCT(c) ((c)->min_DCT_scaled_size)
#endif

#define EXPORT __attribute__((visibility("default")))

struct sk_error { struct jpeg_error_mgr pub; jmp_buf jump; char *msg; int msglen; };

static void sk_fail(j_common_ptr cinfo) {
  struct sk_error *e = (struct sk_error *)cinfo->err;
  char buf[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, buf);
  snprintf(e->msg, e->msglen, "%s", buf);
  longjmp(e->jump, 1);
}

static void sk_message(j_common_ptr cinfo, int level) {
  if (level < 0) sk_fail(cinfo);  /* a warning: corrupt or truncated data */
}

/* Rows [top, top+height) and columns [left, left+width) of a JPEG as RGB into out (height*width*3 bytes).
   0: done; 1: a colour space libjpeg cannot turn into RGB (CMYK, YCCK); -1: an error, described in msg. */
EXPORT int sk_decode_rgb_window(const unsigned char *data, size_t size, int top, int left, int height, int width,
                                unsigned char *out, char *msg, int msglen) {
  struct jpeg_decompress_struct cinfo;
  struct sk_error err;
  JSAMPARRAY row;
  JDIMENSION x0, x1, cw, y0, mcu_w, mcu_h;
  size_t skip, n;
  if (msglen < 2) return -1;
  msg[0] = 0;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = sk_fail;
  err.pub.emit_message = sk_message;
  err.msg = msg; err.msglen = msglen;
  if (setjmp(err.jump)) { jpeg_destroy_decompress(&cinfo); return -1; }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, (unsigned long)size);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) { jpeg_destroy_decompress(&cinfo); return 1; }
  if (top < 0 || left < 0 || height <= 0 || width <= 0 || (JDIMENSION)top + height > cinfo.image_height ||
      (JDIMENSION)left + width > cinfo.image_width) {
    snprintf(msg, msglen, "window %dx%d at (%d, %d) outside the %ux%u image", width, height, left, top,
             cinfo.image_width, cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  /* one MCU of margin on every side: chroma upsampling at the window's edges then sees the neighbours it sees in
     a full decode, and the cropped width never falls to the few pixels at which libjpeg stops upsampling smoothly */
  mcu_w = cinfo.max_h_samp_factor * DCTSIZE;
  mcu_h = cinfo.max_v_samp_factor * DCTSIZE;
  x0 = (JDIMENSION)left > mcu_w ? (JDIMENSION)left - mcu_w : 0;
  x1 = (JDIMENSION)(left + width) + mcu_w < cinfo.output_width ? (JDIMENSION)(left + width) + mcu_w : cinfo.output_width;
  cw = x1 - x0;
  jpeg_crop_scanline(&cinfo, &x0, &cw);  /* widens the columns to whole MCUs */
  row = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, cw * 3, 1);
  y0 = (JDIMENSION)top > mcu_h ? (JDIMENSION)top - mcu_h : 0;
  if (y0) jpeg_skip_scanlines(&cinfo, y0);
  skip = (size_t)(left - x0) * 3;
  n = (size_t)width * 3;
  while (cinfo.output_scanline < (JDIMENSION)(top + height)) {
    JDIMENSION y = cinfo.output_scanline;
    jpeg_read_scanlines(&cinfo, row, 1);
    if (y >= (JDIMENSION)top) memcpy(out + (size_t)(y - top) * n, row[0] + skip, n);
  }
  jpeg_abort_decompress(&cinfo);  /* the rows below the window are never decoded */
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

/* ---- sk_decode_crop: decode + antialiased bilinear resize + flip, in one pass over the decoded rows ----
   The resampling is Pillow's (and torchvision's antialias=True): a triangle filter stretched by the downscale
   factor, weights normalised per output pixel, horizontal pass (rounded to 8 bits) then vertical pass, fixed-point.
   Each decoded row is resampled horizontally while it is in the cache; the window itself is never stored. */

struct sk_axis { int *start, *count, *pairs; short *w; int taps4, prec; };

/* Weights for n outputs over [lo, hi) of an input axis (fractional where the decode is DCT-scaled), sampling only
   the pixels in [clip_lo, clip_hi), as torchvision does when it resizes a crop cut out first. The arithmetic is
   torchvision's, in the crop's own coordinates (from clip_lo), and so are the int16 weights' precision and
   rounding: an unscaled crop comes out exactly as torchvision resizes it. */
static void sk_axis_init(j_common_ptr c, struct sk_axis *a, double lo, double hi, int n, int clip_lo, int clip_hi) {
  double scale = (hi - lo) / n, support = scale < 1.0 ? 1.0 : scale, inv = scale < 1.0 ? 1.0 : 1.0 / scale;
  double shift = lo - clip_lo, maxw = 0.0, *kk;
  int i, j, taps = (int)ceil(support) * 2 + 1, taps4 = (taps + 3) & ~3, prec = 0, size = clip_hi - clip_lo;
  a->start = (int *)(*c->mem->alloc_small)(c, JPOOL_IMAGE, sizeof(int) * n);
  a->count = (int *)(*c->mem->alloc_small)(c, JPOOL_IMAGE, sizeof(int) * n);
  a->w = (short *)(*c->mem->alloc_large)(c, JPOOL_IMAGE, sizeof(short) * n * taps4);
  a->pairs = (int *)(*c->mem->alloc_large)(c, JPOOL_IMAGE, sizeof(int) * n * taps4 / 2);
  kk = (double *)(*c->mem->alloc_large)(c, JPOOL_IMAGE, sizeof(double) * n * taps);
  for (i = 0; i < n; i++) {
    double center = shift + (i + 0.5) * scale, sum = 0.0, *k = kk + (size_t)i * taps;
    int x0 = (int)(center - support + 0.5), x1 = (int)(center + support + 0.5);
    if (x0 < 0) x0 = 0;
    if (x1 > size) x1 = size;
    if (x1 <= x0) x1 = x0 + 1;  /* never empty: a box thinner than a pixel samples its nearest one */
    if (x1 - x0 > taps) x1 = x0 + taps;
    for (j = 0; j < x1 - x0; j++) {
      double t = fabs((j + x0 - center + 0.5) * inv);
      k[j] = t < 1.0 ? 1.0 - t : 0.0;
      sum += k[j];
    }
    for (j = 0; j < x1 - x0; j++) {
      k[j] = sum != 0.0 ? k[j] / sum : 1.0 / (x1 - x0);
      if (k[j] > maxw) maxw = k[j];
    }
    a->start[i] = clip_lo + x0; a->count[i] = x1 - x0;
  }
  while (prec < 22 && (int)(0.5 + maxw * (1 << (prec + 1))) < (1 << 15)) prec++;  /* as precise as int16 allows */
  for (i = 0; i < n * taps4; i++) a->w[i] = 0;  /* zero weights pad every output to taps4 */
  for (i = 0; i < n; i++)
    for (j = 0; j < a->count[i]; j++) a->w[i * taps4 + j] = (short)floor(kk[(size_t)i * taps + j] * (1 << prec) + 0.5);
  for (i = 0; i < n * taps4 / 2; i++) a->pairs[i] = (a->w[2 * i] & 0xffff) | ((int)a->w[2 * i + 1] << 16);
  a->taps4 = taps4; a->prec = prec;
}

static int sk_has_avx2(void) {
#ifdef SK_AVX2
  return __builtin_cpu_supports("avx2");
#else
  return 0;
#endif
}

static unsigned char sk_clip8(int v) { return v < 0 ? 0 : v > 255 ? 255 : (unsigned char)v; }

/* The horizontal pass of four RGBX rows src[0..3] (pixel 0 is input column x0; padded beyond their width by
   4 * taps4 + 32 bytes) to n RGBX pixels each: out rows `ostride` bytes apart. Portable C. */
static void sk_hpass4_c(JSAMPLE *const *src, int x0, const struct sk_axis *a, int n, JSAMPLE *out, size_t ostride) {
  int r, i, k, c;
  for (r = 0; r < 4; r++)
    for (i = 0; i < n; i++) {
      const JSAMPLE *p = src[r] + 4 * (a->start[i] - x0);
      const short *w = a->w + (size_t)i * a->taps4;
      for (c = 0; c < 3; c++) {
        int sum = 1 << (a->prec - 1);
        for (k = 0; k < a->count[i]; k++) sum += p[4 * k + c] * w[k];
        out[r * ostride + 4 * i + c] = sk_clip8(sum >> a->prec);
      }
      out[r * ostride + 4 * i + 3] = 255;
    }
}

/* The vertical pass: rows of RGBX pixels (`rstride` bytes apart; row 0 is input row y0; padded by taps4 rows) to n
   rows of `width` pixels, written as three planes (channel c, row y at out + c*cstride + y*ystride), mirrored if
   flip. Portable C. */
static void sk_vpass_c(const JSAMPLE *rows, size_t rstride, int y0, const struct sk_axis *a, int n, int width,
                       int flip, JSAMPLE *out, ptrdiff_t cstride, ptrdiff_t ystride, int from) {
  int j, k, x, c;
  for (j = 0; j < n; j++) {
    const JSAMPLE *src = rows + (size_t)(a->start[j] - y0) * rstride;
    const short *w = a->w + (size_t)j * a->taps4;
    for (x = from; x < width; x++)
      for (c = 0; c < 3; c++) {
        int sum = 1 << (a->prec - 1);
        for (k = 0; k < a->count[j]; k++) sum += src[(size_t)k * rstride + 4 * x + c] * w[k];
        out[c * cstride + j * ystride + (flip ? width - 1 - x : x)] = sk_clip8(sum >> a->prec);
      }
  }
}

#ifdef SK_AVX2
/* sk_hpass4_c with AVX2: rows 0 and 1 in the halves of one register, 2 and 3 in another; four taps a step, each
   pair of pixels interleaved by channel (r0 r1 g0 g1 b0 b1 x0 x1) and multiplied-added with its pair of weights. */
__attribute__((target("avx2"))) static void sk_hpass4_avx2(JSAMPLE *const *src, int x0, const struct sk_axis *a,
                                                          int n, JSAMPLE *out, size_t ostride) {
  const __m256i lo = _mm256_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1,
                                      0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1);
  const __m256i hi = _mm256_setr_epi8(8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1,
                                      8, -1, 12, -1, 9, -1, 13, -1, 10, -1, 14, -1, 11, -1, 15, -1);
  const __m256i round = _mm256_set1_epi32(1 << (a->prec - 1));
  int i, k;
  for (i = 0; i < n; i++) {
    const int *wp = a->pairs + (size_t)i * (a->taps4 / 2);
    size_t off = 4 * (size_t)(a->start[i] - x0);
    __m256i acc01 = round, acc23 = round, p;
    __m128i l, h;
    int v;
    for (k = 0; k < a->count[i]; k += 4) {
      __m256i w0 = _mm256_set1_epi32(wp[k / 2]), w1 = _mm256_set1_epi32(wp[k / 2 + 1]);
      __m256i s01 = _mm256_inserti128_si256(_mm256_castsi128_si256(
          _mm_loadu_si128((const __m128i *)(src[0] + off + 4 * k))), _mm_loadu_si128((const __m128i *)(src[1] + off + 4 * k)), 1);
      __m256i s23 = _mm256_inserti128_si256(_mm256_castsi128_si256(
          _mm_loadu_si128((const __m128i *)(src[2] + off + 4 * k))), _mm_loadu_si128((const __m128i *)(src[3] + off + 4 * k)), 1);
      acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(s01, lo), w0));
      acc01 = _mm256_add_epi32(acc01, _mm256_madd_epi16(_mm256_shuffle_epi8(s01, hi), w1));
      acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(s23, lo), w0));
      acc23 = _mm256_add_epi32(acc23, _mm256_madd_epi16(_mm256_shuffle_epi8(s23, hi), w1));
    }
    p = _mm256_packs_epi32(_mm256_srai_epi32(acc01, a->prec), _mm256_srai_epi32(acc23, a->prec));
    p = _mm256_packus_epi16(p, p);  /* low half: row 0's pixel, row 2's; high half: row 1's, row 3's */
    l = _mm256_castsi256_si128(p); h = _mm256_extracti128_si256(p, 1);
    v = _mm_cvtsi128_si32(l); memcpy(out + 4 * (size_t)i, &v, 4);
    v = _mm_cvtsi128_si32(h); memcpy(out + ostride + 4 * (size_t)i, &v, 4);
    v = _mm_extract_epi32(l, 1); memcpy(out + 2 * ostride + 4 * (size_t)i, &v, 4);
    v = _mm_extract_epi32(h, 1); memcpy(out + 3 * ostride + 4 * (size_t)i, &v, 4);
  }
}

/* sk_vpass_c with AVX2, eight pixels a step: two rows' bytes interleaved and multiplied-added with their weights,
   then the pixels split into planes (reversed when flipping) and stored eight bytes a plane. */
__attribute__((target("avx2"))) static void sk_vpass_avx2(const JSAMPLE *rows, size_t rstride, int y0,
                                                         const struct sk_axis *a, int n, int width, int flip,
                                                         JSAMPLE *out, ptrdiff_t cstride, ptrdiff_t ystride) {
  const __m256i planes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i mirror = _mm256_setr_epi8(12, 8, 4, 0, 13, 9, 5, 1, 14, 10, 6, 2, 15, 11, 7, 3,
                                          12, 8, 4, 0, 13, 9, 5, 1, 14, 10, 6, 2, 15, 11, 7, 3);
  const __m256i order = flip ? _mm256_setr_epi32(4, 0, 5, 1, 6, 2, 7, 3) : _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i round = _mm256_set1_epi32(1 << (a->prec - 1)), z = _mm256_setzero_si256();
  int j, k, x;
  for (j = 0; j < n; j++) {
    const JSAMPLE *src = rows + (size_t)(a->start[j] - y0) * rstride;
    const int *wp = a->pairs + (size_t)j * (a->taps4 / 2);
    JSAMPLE *o = out + j * ystride;
    for (x = 0; x + 8 <= width; x += 8) {
      __m256i a0 = round, a1 = round, a2 = round, a3 = round, p, q;
      long long v;
      JSAMPLE *dst;
      for (k = 0; k < a->count[j]; k += 2) {  /* the padding rows carry zero weights */
        __m256i s0 = _mm256_loadu_si256((const __m256i *)(src + (size_t)k * rstride + 4 * x));
        __m256i s1 = _mm256_loadu_si256((const __m256i *)(src + (size_t)(k + 1) * rstride + 4 * x));
        __m256i w = _mm256_set1_epi32(wp[k / 2]);
        __m256i l0 = _mm256_unpacklo_epi8(s0, z), l1 = _mm256_unpacklo_epi8(s1, z);
        __m256i h0 = _mm256_unpackhi_epi8(s0, z), h1 = _mm256_unpackhi_epi8(s1, z);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi16(l0, l1), w));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi16(l0, l1), w));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi16(h0, h1), w));
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi16(h0, h1), w));
      }
      p = _mm256_packs_epi32(_mm256_srai_epi32(a0, a->prec), _mm256_srai_epi32(a1, a->prec));
      q = _mm256_packs_epi32(_mm256_srai_epi32(a2, a->prec), _mm256_srai_epi32(a3, a->prec));
      p = _mm256_shuffle_epi8(_mm256_packus_epi16(p, q), flip ? mirror : planes);  /* per half: 4 r, 4 g, 4 b, 4 x */
      p = _mm256_permutevar8x32_epi32(p, order);  /* 8 r, 8 g, 8 b, 8 x */
      dst = o + (flip ? width - 8 - x : x);
      v = _mm256_extract_epi64(p, 0); memcpy(dst, &v, 8);
      v = _mm256_extract_epi64(p, 1); memcpy(dst + cstride, &v, 8);
      v = _mm256_extract_epi64(p, 2); memcpy(dst + 2 * cstride, &v, 8);
    }
  }
  if (width % 8) sk_vpass_c(rows, rstride, y0, a, n, width, flip, out, cstride, ystride, width - width % 8);
}
#endif

/* The box [top, top+height) x [left, left+width) of a JPEG (full-resolution pixels), decoded at scale/8 (1..8),
   resized to out_h x out_w (antialiased bilinear) and mirrored if flip, into three planes: channel c, row y at
   out + c*cstride + y*ystride, pixels contiguous. 0: done; 1: CMYK/YCCK (not done); -1: an error, said in msg. */
EXPORT int sk_decode_crop(const unsigned char *data, size_t size, int top, int left, int height, int width, int scale,
                          int out_h, int out_w, int flip, unsigned char *out, ptrdiff_t cstride, ptrdiff_t ystride,
                          char *msg, int msglen) {
  struct jpeg_decompress_struct cinfo;
  struct sk_error err;
  struct sk_axis ax, ay;
  JSAMPARRAY row;
  JSAMPLE *tmp;
  JDIMENSION x0, cw, y0, mcu_w, mcu_h;
  int cx0, cx1, ry0, ry1, rows, c, avx2;
  size_t rstride;
  double f;
  if (msglen < 2) return -1;
  msg[0] = 0;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = sk_fail;
  err.pub.emit_message = sk_message;
  err.msg = msg; err.msglen = msglen;
  if (setjmp(err.jump)) { jpeg_destroy_decompress(&cinfo); return -1; }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, (unsigned long)size);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) { jpeg_destroy_decompress(&cinfo); return 1; }
  if (top < 0 || left < 0 || height <= 0 || width <= 0 || (JDIMENSION)top + height > cinfo.image_height ||
      (JDIMENSION)left + width > cinfo.image_width) {
    snprintf(msg, msglen, "window %dx%d at (%d, %d) outside the %ux%u image", width, height, left, top,
             cinfo.image_width, cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  if (scale < 1 || scale > 8 || out_h <= 0 || out_w <= 0 || out_h > 65535 || out_w > 65535) {
    snprintf(msg, msglen, "scale %d/8 or output size %dx%d out of range (1..8; 1..65535)", scale, out_w, out_h);
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  cinfo.out_color_space = JCS_EXT_RGBX;  /* 4 bytes a pixel: whole pixels in one load */
  cinfo.scale_num = scale; cinfo.scale_denom = 8;
  jpeg_start_decompress(&cinfo);
  f = scale / 8.0;  /* a scaled pixel i covers full-resolution [i*8/scale, (i+1)*8/scale) */
  {
    double lo = left * f, hi = (left + width) * f, tp = top * f, bt = (top + height) * f;
    int xe = (int)ceil(hi - 1e-9), ye = (int)ceil(bt - 1e-9);
    if (xe > (int)cinfo.output_width) xe = (int)cinfo.output_width;
    if (ye > (int)cinfo.output_height) ye = (int)cinfo.output_height;
    sk_axis_init((j_common_ptr)&cinfo, &ax, lo, hi, out_w, (int)floor(lo + 1e-9), xe);
    sk_axis_init((j_common_ptr)&cinfo, &ay, tp, bt, out_h, (int)floor(tp + 1e-9), ye);
  }
  cx0 = ax.start[0]; cx1 = ax.start[out_w - 1] + ax.count[out_w - 1];
  ry0 = ay.start[0]; ry1 = ay.start[out_h - 1] + ay.count[out_h - 1];
  for (c = 0; c < out_w; c++) {
    if (ax.start[c] < cx0) cx0 = ax.start[c];
    if (ax.start[c] + ax.count[c] > cx1) cx1 = ax.start[c] + ax.count[c];
  }
  for (c = 0; c < out_h; c++) {
    if (ay.start[c] < ry0) ry0 = ay.start[c];
    if (ay.start[c] + ay.count[c] > ry1) ry1 = ay.start[c] + ay.count[c];
  }
  /* one MCU of margin, as in sk_decode_rgb_window: edge pixels as in a full decode */
  mcu_w = cinfo.max_h_samp_factor * SK_MIN_DCT(&cinfo);
  mcu_h = cinfo.max_v_samp_factor * SK_MIN_DCT(&cinfo);
  x0 = (JDIMENSION)cx0 > mcu_w ? (JDIMENSION)cx0 - mcu_w : 0;
  cw = ((JDIMENSION)cx1 + mcu_w < cinfo.output_width ? (JDIMENSION)cx1 + mcu_w : cinfo.output_width) - x0;
  jpeg_crop_scanline(&cinfo, &x0, &cw);
  /* rows padded so that whole steps of taps may be read past their ends (with zero weights) */
  row = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, cw * 4 + 4 * ax.taps4 + 32, 4);
  rows = ry1 - ry0;
  rstride = (size_t)out_w * 4 + 32;
  tmp = (JSAMPLE *)(*cinfo.mem->alloc_large)((j_common_ptr)&cinfo, JPOOL_IMAGE, rstride * (rows + ay.taps4 + 4));
  memset(tmp + rstride * rows, 0, rstride * (ay.taps4 + 4));
  y0 = (JDIMENSION)ry0 > mcu_h ? (JDIMENSION)ry0 - mcu_h : 0;
  if (y0) jpeg_skip_scanlines(&cinfo, y0);
  while (cinfo.output_scanline < (JDIMENSION)ry0) jpeg_read_scanlines(&cinfo, row, 1);
  avx2 = sk_has_avx2();
  while (cinfo.output_scanline < (JDIMENSION)ry1) {  /* four rows at a time; the last few written past the end */
    int got = 0, y = (int)cinfo.output_scanline - ry0;
    while (got < 4 && cinfo.output_scanline < (JDIMENSION)ry1)
      got += (int)jpeg_read_scanlines(&cinfo, row + got, 4 - got);
    for (c = got; c < 4; c++) memcpy(row[c], row[0], cw * 4);
#ifdef SK_AVX2
    if (avx2) { sk_hpass4_avx2(row, (int)x0, &ax, out_w, tmp + y * rstride, rstride); continue; }
#endif
    sk_hpass4_c(row, (int)x0, &ax, out_w, tmp + y * rstride, rstride);
  }
#ifdef SK_AVX2
  if (avx2) sk_vpass_avx2(tmp, rstride, ry0, &ay, out_h, out_w, flip, out, cstride, ystride);
  else
#endif
  sk_vpass_c(tmp, rstride, ry0, &ay, out_h, out_w, flip, out, cstride, ystride, 0);
  jpeg_abort_decompress(&cinfo);  /* the rows below the crop are never decoded */
  jpeg_destroy_decompress(&cinfo);
  return 0;
}
