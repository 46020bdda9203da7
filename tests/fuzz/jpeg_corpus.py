"""JPEG seeds for the C decoder (`jpeg_window`: an 8-byte prefix of call parameters, then the JPEG) and the header
probe (`jpeg_header`: the JPEG alone): baseline and progressive, 4:4:4/4:2:2/4:2:0, grey and CMYK, restart markers,
odd sizes, truncated and corrupted files, headers that claim huge sizes. Made with PIL, deterministic."""
from __future__ import annotations
import io
import numpy as np
from PIL import Image
from .core import CORPUS


def _picture(w: int, h: int, mode: str = "RGB") -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(w * h).integers(0, 30, (h, w, 3))
    rgb = np.stack([x * 7 % 256, y * 5 % 256, (x * y) % 256], -1) + noise
    im = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    return im.convert(mode) if mode != "RGB" else im


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=kw.pop("quality", 75), **kw)
    return buf.getvalue()


def _claim(data: bytes, w: int, h: int) -> bytes:
    "`data` with its frame header claiming `w` x `h`."
    i = 2
    while i + 9 <= len(data):
        marker, n = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xC2:
            return data[:i + 5] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + data[i + 9:]
        i += 2 + n
    return data


def seeds() -> dict[str, bytes]:
    s = {}
    for name, sub in (("444", 0), ("422", 1), ("420", 2)):
        s[f"baseline-{name}"] = _jpeg(_picture(48, 40), subsampling=sub)
        s[f"progressive-{name}"] = _jpeg(_picture(40, 33), subsampling=sub, progressive=True)
    s["grey"] = _jpeg(_picture(33, 17, "L"))
    s["grey-progressive"] = _jpeg(_picture(20, 31, "L"), progressive=True)
    s["cmyk"] = _jpeg(_picture(24, 16, "CMYK"))
    s["restart-markers"] = _jpeg(_picture(64, 48), restart_marker_blocks=2)
    s["restart-rows"] = _jpeg(_picture(35, 50), restart_marker_rows=1, progressive=True)
    s["odd-1x1"] = _jpeg(_picture(1, 1))
    s["odd-17x3"] = _jpeg(_picture(17, 3), subsampling=2)
    s["odd-3x97"] = _jpeg(_picture(3, 97), subsampling=1)
    good = s["baseline-420"]
    s["truncated-half"] = good[:len(good) // 2]
    s["truncated-header"] = good[:40]
    bad = bytearray(good); bad[len(bad) // 2:len(bad) // 2 + 16] = b"\xff" * 16
    s["corrupted"] = bytes(bad)
    s["huge-baseline"] = _claim(good, 65500, 65500)
    s["huge-progressive"] = _claim(s["progressive-420"], 60000, 9000)
    s["zero-height"] = _claim(good, 48, 0)
    return s


def main():
    for name, data in seeds().items():
        for target, prefix in (("jpeg_window", bytes([3, 5, 40, 30, 7, 24, 24, 1])), ("jpeg_header", b"")):
            d = CORPUS / target
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(prefix + data)
