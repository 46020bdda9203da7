/* shardkit's crop-window JPEG decoder: decode only the rows and columns a crop keeps, with exactly the pixels of a
   full decode (nbs/22_jpeg.ipynb explains it). Built at install time as the optional extension
   shardkit.native._jpeg_window (setup.py), else at first use into $SHARDKIT_HOME/native; loaded with ctypes by
   shardkit.loading.jpeg, which calls the one exported function. Needs libjpeg-turbo 1.5 or newer (jpeg_crop_scanline,
   jpeg_skip_scanlines). */
#include <stdio.h>
#include <string.h>
#include <setjmp.h>
#include <jpeglib.h>

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
