/* libFuzzer target for shardkit's C JPEG decoder (shardkit/native/jpeg_window.c), built apart from the installed
   library under AddressSanitizer and UndefinedBehaviorSanitizer (tests/fuzz/run.py builds it).
   Input: 8 bytes of call parameters, then the JPEG. Each input goes through the decoder's public calls as the loader
   makes them: the header probe (libjpeg's jpeg_read_header, behind the loader's pixel bound), the whole image
   (sk_decode_rgb_window over all of it), a window of it, and a crop resized at a DCT scale M/8 (sk_decode_crop),
   plus windows outside the image. Invariants, beyond the sanitizers': each call answers 0, 1 (CMYK) or -1 with a
   message; a window decoded alone equals the same window of the whole image (where libjpeg's block smoothing of an
   incomplete progressive JPEG leaves the pixels alone: see smoothing_matters); a window of an image that decodes
   whole decodes too; a crop answers as the whole image did. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <jpeglib.h>

int sk_decode_rgb_window(const unsigned char *, size_t, int, int, int, int, unsigned char *, char *, int);
int sk_decode_crop(const unsigned char *, size_t, int, int, int, int, int, int, int, int, unsigned char *, ptrdiff_t,
                   ptrdiff_t, char *, int);

#define MAX_PIXELS 50000000L   /* shards/fields.py MAX_PIXELS: the loader refuses larger images from their header */
#define FUZZ_PIXELS 1000000L   /* decoded in the fuzz loop up to this many (more: the probe and a 1x1 window only) */
#define FULL_PIXELS 262144L    /* decoded whole (the differential check) up to this many: keeps each input fast */

struct probe_err { struct jpeg_error_mgr pub; jmp_buf jump; };
static void probe_fail(j_common_ptr c) { longjmp(((struct probe_err *)c->err)->jump, 1); }
static void probe_quiet(j_common_ptr c, int level) { (void)c; (void)level; }

/* the header probe: (width, height, colour space) from libjpeg, or 0 where it refuses the header */
static int probe(const uint8_t *d, size_t n, unsigned *w, unsigned *h, int *cs) {
  struct jpeg_decompress_struct c;
  struct probe_err e;
  c.err = jpeg_std_error(&e.pub);
  e.pub.error_exit = probe_fail; e.pub.emit_message = probe_quiet;
  if (setjmp(e.jump)) { jpeg_destroy_decompress(&c); return 0; }
  jpeg_create_decompress(&c);
  jpeg_mem_src(&c, d, (unsigned long)n);
  jpeg_read_header(&c, TRUE);
  *w = c.image_width; *h = c.image_height; *cs = c.jpeg_color_space;
  jpeg_destroy_decompress(&c);
  return 1;
}

/* whether libjpeg's block smoothing changes the image: a progressive JPEG whose scans leave AC coefficients out is
   smoothed from each block's neighbours, which a window decode (jpeg_crop_scanline) does not all read, so there a
   window may differ from the whole image by a level or two (the whole decode matches PIL's); -1 where it fails */
static int decode_rgb(const uint8_t *d, size_t n, int smoothing, unsigned char *out, size_t cap) {
  struct jpeg_decompress_struct c;
  struct probe_err e;
  size_t at = 0;
  c.err = jpeg_std_error(&e.pub);
  e.pub.error_exit = probe_fail; e.pub.emit_message = probe_quiet;
  if (setjmp(e.jump)) { jpeg_destroy_decompress(&c); return -1; }
  jpeg_create_decompress(&c);
  jpeg_mem_src(&c, d, (unsigned long)n);
  jpeg_read_header(&c, TRUE);
  c.do_block_smoothing = smoothing ? TRUE : FALSE;
  c.out_color_space = JCS_RGB;
  jpeg_start_decompress(&c);
  while (c.output_scanline < c.output_height) {
    JSAMPROW row = out + at;
    if (at + 3 * (size_t)c.output_width > cap) { jpeg_destroy_decompress(&c); return -1; }
    jpeg_read_scanlines(&c, &row, 1);
    at += 3 * (size_t)c.output_width;
  }
  jpeg_destroy_decompress(&c);
  return 0;
}

static int smoothing_matters(const uint8_t *d, size_t n, unsigned w, unsigned h) {
  size_t cap = (size_t)w * h * 3;
  unsigned char *a = malloc(cap), *b = malloc(cap);
  int r = decode_rgb(d, n, 1, a, cap) || decode_rgb(d, n, 0, b, cap) ? -1 : memcmp(a, b, cap) != 0;
  free(a); free(b);
  return r;
}

static void check_answer(int r, const char *msg, const char *call) {
  if (r != 0 && r != 1 && r != -1) { fprintf(stderr, "%s answered %d\n", call, r); abort(); }
  if (r == -1 && !msg[0]) { fprintf(stderr, "%s failed without a message\n", call); abort(); }
  if (strnlen(msg, 256) >= 256) { fprintf(stderr, "%s: message not terminated\n", call); abort(); }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char msg[256];
  unsigned w = 0, h = 0;
  int cs = 0, r, rw, rc;
  const uint8_t *p = data;
  const uint8_t *jpg = data + 8;
  size_t n;
  if (size < 8) return 0;
  n = size - 8;
  /* windows and crops outside the image, or with no pixels: refused with a message whatever the JPEG */
  {
    unsigned char one[3];
    r = sk_decode_rgb_window(jpg, n, -1, 0, 1, 1, one, msg, sizeof msg); check_answer(r, msg, "window(-1)");
    if (r == 0) { fprintf(stderr, "a window at row -1 was decoded\n"); abort(); }
    r = sk_decode_crop(jpg, n, 0, 0, 0, 1, 8, 1, 1, 0, one, 1, 1, msg, sizeof msg); check_answer(r, msg, "crop(h=0)");
    if (r == 0) { fprintf(stderr, "a crop of height 0 was decoded\n"); abort(); }
  }
  if (!probe(jpg, n, &w, &h, &cs) || !w || !h || (long)w * h > MAX_PIXELS) return 0;  /* refused from the header */
  if ((long)w * h > FUZZ_PIXELS) {
    unsigned char one[3];
    r = sk_decode_rgb_window(jpg, n, 0, 0, 1, 1, one, msg, sizeof msg); check_answer(r, msg, "window(1x1)");
    return 0;
  }
  {
    int top = (int)(p[0] * (uint64_t)h / 256), left = (int)(p[1] * (uint64_t)w / 256);
    int wh = 1 + (int)(p[2] * (uint64_t)(h - top - 1) / 255), ww = 1 + (int)(p[3] * (uint64_t)(w - left - 1) / 255);
    int scale = 1 + p[4] % 8, out_h = 1 + p[5] % 48, out_w = 1 + p[6] % 48, flip = p[7] & 1;
    size_t cstride = (size_t)out_h * out_w;
    unsigned char *crop = malloc(3 * cstride), *win = malloc((size_t)wh * ww * 3), *full = NULL;
    if ((long)w * h <= FULL_PIXELS) {
      full = malloc((size_t)w * h * 3);
      r = sk_decode_rgb_window(jpg, n, 0, 0, (int)h, (int)w, full, msg, sizeof msg); check_answer(r, msg, "whole");
    } else r = 2;  /* not decoded whole: too large to do for every input */
    rw = sk_decode_rgb_window(jpg, n, top, left, wh, ww, win, msg, sizeof msg); check_answer(rw, msg, "window");
    if (r == 0) {
      int y, smooth = smoothing_matters(jpg, n, w, h);  /* 1: exact equality is not libjpeg's promise here */
      if (rw != 0) { fprintf(stderr, "the whole %ux%u image decodes, its window %dx%d at (%d, %d) not: %s\n", w, h,
                             ww, wh, left, top, msg); abort(); }
      for (y = 0; y < wh && smooth != 1; y++)
        if (memcmp(win + (size_t)y * ww * 3, full + ((size_t)(top + y) * w + left) * 3, (size_t)ww * 3)) {
          fprintf(stderr, "window %dx%d at (%d, %d) of %ux%u differs from the whole image's at row %d\n", ww, wh,
                  left, top, w, h, y);
          abort();
        }
    }
    if (r == 1 && rw != 1) { fprintf(stderr, "CMYK whole, window answered %d\n", rw); abort(); }
    rc = sk_decode_crop(jpg, n, top, left, wh, ww, scale, out_h, out_w, flip, crop, (ptrdiff_t)cstride, out_w, msg,
                        sizeof msg);
    check_answer(rc, msg, "crop");
    if (r == 0 && rc != 0) { fprintf(stderr, "the whole image decodes, its crop (scale %d/8) not: %s\n", scale, msg);
                             abort(); }
    free(full); free(win); free(crop);
  }
  return 0;
}
