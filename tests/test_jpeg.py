"""The crop-window JPEG decoder (shardkit.loading.jpeg): every window of every JPEG layout (4:4:4, 4:2:2, 4:2:0, progressive,
greyscale, restart markers, odd sizes, smaller than one MCU) has the pixels of torchvision's full decode; bad input is a
JpegError that says what libjpeg found; a JPEG cut short below the window still yields it; where the native decoder
cannot be built or is turned off, `why_no_window_decode()` says why and windows are cut from full decodes (run in
subprocesses, as that state is per process); CMYK goes to the full decoder. Where this machine cannot build the native
decoder, the pixel tests check the fallback and the tests that need the native path skip with the reason.

The decoder comes from the extension built at install time (shardkit/native/_jpeg_window.*.so) when it is there and
trusted, else from the runtime build in SHARDKIT_HOME/native. The tests of the runtime build set
SHARDKIT_JPEG_WINDOW=build, which skips the installed extension, so they test that path on any machine; the tests of
the installed one point `jpeg._NATIVE` at a folder of their own, and a slow test builds wheels with pip."""
import importlib.machinery, io, json, os, pickle, shutil, subprocess, sys, textwrap, zipfile
from pathlib import Path
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import ImageReadMode, decode_jpeg
from shardkit.loading.jpeg import CropBox, EncodedJpeg, JpegError, decode_window, why_no_window_decode
from shardkit.loading.decode import TrainTransform, crop_box
from shardkit.errors import ShardkitError


def _jpeg(w, h, mode="RGB", seed=0, **save):
    "A photo-like JPEG: gradients and a wave in different channels (so chroma subsampling matters) plus noise."
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), 128 + 100 * np.sin(x / 7 + y / 5)], -1)
    rgb = rgb + rng.integers(-30, 30, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).convert(mode).save(buf, "JPEG", **{"quality": 85, **save})
    return buf.getvalue()


def _full(data):
    "torchvision's decode of the whole image: the truth every window is compared with."
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _segments(data):
    "(marker, offset, length) of each header segment, up to and including the first SOS."
    i = 2
    while i + 4 <= len(data):
        marker, n = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        yield marker, i, n
        if marker == 0xDA: return
        i += 2 + n


def _frame(data):
    "(SOF marker, [(h, v) sampling factors of each component]): which layout PIL really wrote."
    for marker, i, _ in _segments(data):
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker, [(data[i + 11 + 3 * c] >> 4, data[i + 11 + 3 * c] & 15) for c in range(data[i + 9])]


def _bogus_huffman(data):
    "The first Huffman table's code counts set to 255 each: more codes than 16 bits hold."
    i = next(i for m, i, _ in _segments(data) if m == 0xC4)
    return data[:i + 5] + bytes([255] * 16) + data[i + 21:]


def _marker_in_scan(data):
    "An EOI marker written over the middle of the (single, baseline) scan."
    i, n = next((i, n) for m, i, n in _segments(data) if m == 0xDA)
    mid = (i + 2 + n + len(data) - 2) // 2
    return data[:mid] + b"\xff\xd9" + data[mid + 2:]


def _windows(h, w, gen, n=8):
    "n RandomResizedCrop boxes, the whole image, its corners, strips 1 to 3 pixels wide along every edge, a thin cross."
    boxes = [crop_box(h, w, generator=gen) for _ in range(n)]
    edges = [(0, 0, h, w), (0, 0, 1, 1), (0, w - 1, 1, 1), (h - 1, 0, 1, 1), (h - 1, w - 1, 1, 1),
             (h // 2, w // 2, h - h // 2, 1), (h // 2, w // 2, 1, w - w // 2)]
    for k in (1, 2, 3):
        kw, kh = min(k, w), min(k, h)
        edges += [(0, 0, h, kw), (0, w - kw, h, kw), (0, 0, kh, w), (h - kh, 0, kh, w), (h - kh, w - kw, kh, kw)]
    return list(dict.fromkeys(boxes + [CropBox(*e) for e in edges]))


@pytest.fixture(scope="module")
def native():
    "The native decoder, built (once per machine) and checked as the loader does; a skip with the reason where it cannot be."
    why = why_no_window_decode()
    if why: pytest.skip(f"the native window decoder is not available here: {why}")


# (PIL save options, expected SOF marker, expected sampling factors)
LAYOUTS = {
    "4:4:4": (dict(subsampling=0), 0xC0, [(1, 1)] * 3),
    "4:2:2": (dict(subsampling=1), 0xC0, [(2, 1), (1, 1), (1, 1)]),
    "4:2:0": (dict(subsampling=2), 0xC0, [(2, 2), (1, 1), (1, 1)]),
    "progressive": (dict(subsampling=2, progressive=True), 0xC2, [(2, 2), (1, 1), (1, 1)]),
    "grey": (dict(mode="L"), 0xC0, [(1, 1)]),
    "restarts": (dict(subsampling=2, restart_marker_rows=1), 0xC0, [(2, 2), (1, 1), (1, 1)]),
}
SIZES = [(160, 120), (33, 17), (7, 5)]  # photo-like, odd, smaller than one MCU


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_window_equals_the_full_decode(layout, size):
    save, sof, sampling = LAYOUTS[layout]
    (w, h), seed = size, list(LAYOUTS).index(layout) * 10 + SIZES.index(size)
    data = _jpeg(w, h, seed=seed, **save)
    assert _frame(data) == (sof, sampling), "PIL wrote the layout asked for"
    assert layout != "restarts" or b"\xff\xdd" in data
    whole, enc, here = _full(data), EncodedJpeg(data, w, h), why_no_window_decode() is None
    assert tuple(enc.shape) == (3, h, w)
    boxes = _windows(h, w, torch.Generator().manual_seed(seed))
    assert any(0 < bw < w for _, _, _, bw in boxes) and any(left + bw == w and bw <= 3 for _, left, _, bw in boxes)
    for box in boxes:
        want = box.cut(whole)
        got = enc.window(box)  # the native decoder where it is built here, else a cut from a full decode
        assert got.dtype == torch.uint8 and tuple(got.shape) == (3, box.height, box.width), box
        assert torch.equal(got, want), f"window {box} of a {w}x{h} {layout} JPEG differs from the full decode's"
        if here: assert torch.equal(decode_window(data, box), want), f"decode_window {box}, {w}x{h} {layout}"
    if layout == "grey": assert torch.equal(whole[0], whole[1]) and torch.equal(whole[1], whole[2])


def test_train_transform_crops_an_encoded_jpeg_as_the_decoded_image():
    data = _jpeg(160, 120, subsampling=2, seed=7)
    tf = TrainTransform(32)
    for seed in range(6):
        torch.manual_seed(seed); a = tf(EncodedJpeg(data, 160, 120))
        torch.manual_seed(seed); b = tf(tv_tensors.Image(_full(data)))
        assert a.shape == (3, 32, 32) and torch.equal(a, b), seed


def test_the_loader_hands_over_encoded_jpegs_when_windows_decode(native):
    assert decode_window(_jpeg(61, 45), CropBox(7, 13, 20, 31)).shape == (3, 20, 31)
    assert TrainTransform(crop_decode=True).takes_encoded() is True
    assert TrainTransform(crop_decode=False).takes_encoded() is False


DATA = _jpeg(120, 90, subsampling=2, seed=3)  # baseline 4:2:0, one scan


@pytest.mark.parametrize("bad, fragment", [
    (_bogus_huffman(DATA), "Bogus Huffman table definition"),
    (_marker_in_scan(DATA), "Corrupt JPEG data"),
    (DATA[:len(DATA) // 2], "Premature end of JPEG file"),  # the cut is above the window (the bottom rows)
    (b"not a jpeg at all", "Not a JPEG file"),
    (b"", "Empty input file"),
    (b"\xff\xd8", "Premature end of JPEG file"),
], ids=["bogus-huffman", "marker-in-scan", "truncated", "not-a-jpeg", "empty", "only-soi"])
def test_bad_jpegs_are_errors_that_say_what_libjpeg_found(native, bad, fragment):
    with pytest.raises(JpegError, match=f"^cannot decode this JPEG: .*{fragment}") as e:
        decode_window(bad, CropBox(82, 0, 8, 120))
    assert isinstance(e.value, ShardkitError) and isinstance(e.value, ValueError)
    with pytest.raises(JpegError, match=fragment): EncodedJpeg(bad, 120, 90).window(CropBox(82, 0, 8, 120))


@pytest.mark.parametrize("bad", [_bogus_huffman(DATA), DATA[:len(DATA) // 2], b"not a jpeg at all"],
                         ids=["bogus-huffman", "truncated", "not-a-jpeg"])
def test_bad_jpegs_are_jpeg_errors_on_either_path(bad):
    with pytest.raises(JpegError, match="^cannot decode this JPEG: ."):
        EncodedJpeg(bad, 120, 90).window(CropBox(82, 0, 8, 120))
    with pytest.raises(JpegError, match="^cannot decode this JPEG: ."):
        EncodedJpeg(bad, 120, 90).decode()


@pytest.mark.parametrize("box", [(50, 0, 41, 120), (0, 100, 5, 21), (-1, 0, 5, 5), (0, -1, 5, 5), (0, 0, 0, 5),
                                 (0, 0, 5, 0), (90, 0, 1, 1), (0, 120, 1, 1)])
def test_a_window_outside_the_image_is_refused(native, box):
    top, left, h, w = box
    with pytest.raises(JpegError, match=rf"window {w}x{h} at \({left}, {top}\) outside the 120x90 image"):
        decode_window(DATA, CropBox(*box))
    with pytest.raises(JpegError, match="outside the 120x90 image"): EncodedJpeg(DATA, 120, 90).window(CropBox(*box))


@pytest.mark.parametrize("box", [(0, 0, -1, 5), (0, 0, 5, -7), (0, 0, 70000, 5), (0, 0, 5, 2**31 - 1)])
def test_a_window_of_negative_or_impossible_size_is_a_jpeg_error(native, box):
    top, left, h, w = box
    with pytest.raises(JpegError, match=rf"window {w}x{h} at \(0, 0\) outside the 120x90 image"):
        decode_window(DATA, CropBox(*box))
    with pytest.raises(JpegError, match="outside the 120x90 image"): EncodedJpeg(DATA, 120, 90).window(CropBox(*box))


def test_a_jpeg_cut_below_the_window_still_yields_it(native):
    data = _jpeg(120, 90, subsampling=0, seed=4)
    cut = data[:int(len(data) * 0.6)]
    with pytest.raises(JpegError, match="incomplete or truncated"): EncodedJpeg(cut, 120, 90).decode()
    with pytest.raises(JpegError, match="Premature end"): decode_window(cut, CropBox(74, 0, 16, 120))  # the cut
    # is above this one
    for box in [CropBox(0, 0, 16, 120), CropBox(16, 40, 16, 40), CropBox(0, 119, 20, 1)]:
        assert torch.equal(decode_window(cut, box), box.cut(_full(data))), box
        assert torch.equal(EncodedJpeg(cut, 120, 90).window(box), box.cut(_full(data))), box


def test_a_cut_progressive_jpeg_is_an_error_even_above_the_cut(native):
    data = _jpeg(120, 90, subsampling=2, progressive=True, seed=5)  # its scans each cover the whole image
    with pytest.raises(JpegError, match="Premature end of JPEG file"): decode_window(data[:int(len(data) * 0.9)],
                                                                                     CropBox(0, 0, 8, 120))


def _cmyk(w=40, h=30):
    rgb = np.asarray(Image.open(io.BytesIO(_jpeg(w, h, seed=6))).convert("RGB"))
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_cmyk_jpegs_are_cut_from_the_full_decode():
    data = _cmyk()
    assert len(_frame(data)[1]) == 4, "a four-component JPEG"
    whole = _full(data)
    assert whole.shape == (3, 30, 40) and whole.float().std() > 10, "torchvision decodes it to a picture"
    for box in _windows(30, 40, torch.Generator().manual_seed(6), n=4):
        assert torch.equal(EncodedJpeg(data, 40, 30).window(box), box.cut(whole)), box


def test_decode_window_leaves_cmyk_to_the_full_decoder(native):
    assert decode_window(_cmyk(), CropBox(2, 3, 10, 12)) is None


@pytest.mark.parametrize("box", [(20, 0, 11, 40), (0, 30, 5, 11), (-1, 0, 5, 5), (0, 0, -1, 5), (0, 0, 0, 5), (30, 0, 1, 1)])
def test_a_window_outside_a_cmyk_jpeg_is_refused_too(box):
    "CMYK takes the full-decode path always (every JPEG does where windows cannot be decoded): refused there as well."
    top, left, h, w = box
    with pytest.raises(JpegError, match=rf"^cannot decode this JPEG: window {w}x{h} at \({left}, {top}\) outside the 40x30 image"):
        EncodedJpeg(_cmyk(), 40, 30).window(CropBox(*box))


def test_an_empty_jpeg_is_a_jpeg_error_on_the_full_decode_path():
    with pytest.raises(JpegError, match="^cannot decode this JPEG: Empty input file"): EncodedJpeg(b"", 1, 1).decode()
    with pytest.raises(JpegError, match="^cannot decode this JPEG: Empty input file"):
        EncodedJpeg(b"", 1, 1).window(CropBox(0, 0, 1, 1))


ELSEWHERE = textwrap.dedent(r'''
    import json, os, pickle, sys
    from pathlib import Path
    from shardkit.loading import jpeg
    from shardkit.loading.jpeg import CropBox, EncodedJpeg, decode_window, why_no_window_decode
    from shardkit.loading.decode import TrainTransform
    with open(sys.argv[1], "rb") as f: cases, bad = pickle.load(f)
    native = Path(os.environ["SHARDKIT_HOME"]) / "native"
    out = {"why": why_no_window_decode(), "takes_encoded": TrainTransform(crop_decode=True).takes_encoded(), "errors": {}}
    out["native_files"] = sorted(os.listdir(native)) if native.exists() else None
    try: decode_window(cases[0][0], CropBox(0, 0, 1, 1)); out["decode_window"] = "no error"
    except Exception as e: out["decode_window"] = f"{type(e).__name__}: {e}"
    for name, (data, box) in bad.items():
        try: EncodedJpeg(data, 120, 90).window(CropBox(*box)); out["errors"][name] = "no error"
        except Exception as e: out["errors"][name] = f"{type(e).__name__}: {e}"
    windows = [[EncodedJpeg(d, w, h).window(b) for b in boxes] for d, w, h, boxes in cases]
    if sys.argv[3] == "no-compiler":  # a compiler that runs but cannot build: a second try, in this process only
        del os.environ["CC"]; os.environ["CFLAGS"] = "-nostdinc"; jpeg._decoder.cache_clear()
        out["failed_build"] = why_no_window_decode()
    with open(sys.argv[2], "wb") as f: pickle.dump(windows, f)
    print(json.dumps(out))
''')


def _run_elsewhere(tmp_path, env, mode):
    "ELSEWHERE in a fresh interpreter with `env`; its report, and the windows it cut, with the truth they must equal."
    gen = torch.Generator().manual_seed(9)
    cases = [(_jpeg(w, h, seed=9, **save), w, h) for (w, h), save in
             [((160, 120), dict(subsampling=2)), ((33, 17), dict(subsampling=1)), ((7, 5), dict(mode="L"))]] + [(_cmyk(), 40, 30)]
    cases = [(d, w, h, _windows(h, w, gen, n=3)) for d, w, h in cases]
    bottom, top = (82, 0, 8, 120), (0, 0, 8, 120)
    bad = {"truncated": (DATA[:len(DATA) // 2], bottom), "not-a-jpeg": (b"not a jpeg at all", bottom),
           "bogus-huffman": (_bogus_huffman(DATA), bottom), "cut-below-the-window": (DATA[:len(DATA) // 2], top)}
    (tmp_path / "in.pkl").write_bytes(pickle.dumps((cases, bad)))
    env = {**{k: v for k, v in os.environ.items() if k not in ("SHARDKIT_JPEG_WINDOW", "CC", "CFLAGS", "LDFLAGS")},
           "SHARDKIT_HOME": str(tmp_path / "home"), **env}
    r = subprocess.run([sys.executable, "-c", ELSEWHERE, str(tmp_path / "in.pkl"), str(tmp_path / "out.pkl"), mode],
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    windows = pickle.loads((tmp_path / "out.pkl").read_bytes())
    for (d, w, h, boxes), got in zip(cases, windows, strict=True):
        for box, x in zip(boxes, got, strict=True):
            assert torch.equal(x, box.cut(_full(d))), f"window {box} of a {w}x{h} JPEG cut in the subprocess"
    assert set(out["errors"]) == set(bad)
    for name, msg in out["errors"].items():  # cut below the window too: the full decoder needs all of it
        assert msg.startswith("JpegError: cannot decode this JPEG: "), (name, msg)
    assert out["takes_encoded"] is False, "the loader decodes whole images"
    return out


@pytest.mark.slow
def test_without_a_compiler_windows_are_cut_from_full_decodes(tmp_path):
    out = _run_elsewhere(tmp_path, {"CC": "/nonexistent/cc", "SHARDKIT_JPEG_WINDOW": "build"}, "no-compiler")
    why = out["why"]
    assert why and "/nonexistent/cc" in why and "failed to run" in why, why
    assert "install a C compiler" in why and "apt-get install gcc libjpeg-dev" in why, why
    assert out["decode_window"] == f"ShardkitError: JPEG windows cannot be decoded here: {why}"
    assert out["native_files"] == [".lock"], "no library and no half-built folder left in SHARDKIT_HOME, just the lock"
    failed = out["failed_build"]
    assert failed and "install a C compiler" in failed, failed
    assert "compiling the window decoder failed" in failed or "no C compiler found" in failed, failed


@pytest.mark.slow
def test_shardkit_jpeg_window_0_turns_window_decoding_off(tmp_path):
    out = _run_elsewhere(tmp_path, {"SHARDKIT_JPEG_WINDOW": "0"}, "off")
    assert out["why"] == "turned off by SHARDKIT_JPEG_WINDOW"
    assert out["decode_window"] == "ShardkitError: JPEG windows cannot be decoded here: turned off by SHARDKIT_JPEG_WINDOW"
    assert out["native_files"] is None, "nothing was compiled"


TRUST = textwrap.dedent(r'''
    import json, sys, warnings
    from pathlib import Path
    from shardkit.loading import jpeg
    if len(sys.argv) > 1: jpeg._NATIVE = Path(sys.argv[1])  # the folder an installed extension is looked for in
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        why, loaded = jpeg.why_no_window_decode(), jpeg.window_decoder_path()
    print(json.dumps({"why": why, "path": str(jpeg._library_path()), "loaded": loaded and str(loaded),
                      "installed": str(jpeg._installed_library()),
                      "warnings": [str(w.message) for w in caught if "window decoder" in str(w.message)]}))
''')


def _in_fresh_process(home, *args, **env):
    """why_no_window_decode(), the runtime build's path and the file loaded, in a fresh interpreter (a clean lru_cache)
    with SHARDKIT_HOME=home; `args`: the folder to look for an installed extension in, instead of shardkit/native."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("SHARDKIT_JPEG_WINDOW", "CC", "CFLAGS", "LDFLAGS")},
           "SHARDKIT_HOME": str(home), **env}
    return subprocess.Popen([sys.executable, "-c", TRUST, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, env=env)


def _report(p):
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _plant(tmp_path, path):
    "A library at `path` whose constructor, run the moment anything loads it, leaves a marker file; the marker's path."
    marker = tmp_path / "constructor-ran"
    (tmp_path / "evil.c").write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                                     f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
                                     'int sk_decode_rgb_window(void) { return 0; }\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    r = subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(tmp_path / "evil.c")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return marker


@pytest.mark.slow
def test_a_planted_library_in_a_folder_others_can_write_is_never_loaded(tmp_path):
    if not (shutil.which("cc") or shutil.which("gcc")): pytest.skip("no C compiler to build the planted library")
    home = tmp_path / "home"
    path = Path(_report(_in_fresh_process(home, SHARDKIT_JPEG_WINDOW="0"))["path"])
    marker = _plant(tmp_path, path)
    home.chmod(0o775)  # a group-writable SHARDKIT_HOME: anyone in the group could have planted it
    why = _report(_in_fresh_process(home, SHARDKIT_JPEG_WINDOW="build"))["why"]
    assert not marker.exists(), "the planted library was loaded"
    assert why and "\n" not in why and f"chmod go-w {home}" in why and "SHARDKIT_HOME" in why, why
    home.chmod(0o700)
    path.parent.chmod(0o777)  # native/ writable by anyone
    why = _report(_in_fresh_process(home, SHARDKIT_JPEG_WINDOW="build"))["why"]
    assert not marker.exists() and f"chmod go-w {path.parent}" in why, why


def _can_build():
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not Path("/usr/include/jpeglib.h").exists(): pytest.skip("no C compiler or no libjpeg headers here")
    return cc


@pytest.mark.slow
def test_a_planted_extension_in_a_folder_others_can_write_is_never_loaded(tmp_path):
    "An installed extension that is not ours is refused with the path and the fix; the runtime build takes over, with a warning."
    _can_build()
    folder, home = tmp_path / "native", tmp_path / "home"
    ext = folder / f"_jpeg_window{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    marker = _plant(tmp_path, ext)
    folder.chmod(0o775)
    r = _report(_in_fresh_process(home, folder))
    assert not marker.exists(), "the planted extension was loaded"
    assert r["installed"] == str(ext) and r["why"] is None and r["loaded"] == r["path"], r  # the runtime build instead
    assert len(r["warnings"]) == 1 and f"refusing to load the installed window decoder: {folder} can be written by others" \
        in r["warnings"][0] and f"chmod go-w {folder}" in r["warnings"][0], r["warnings"]
    folder.chmod(0o755)
    ext.chmod(0o666)
    r = _report(_in_fresh_process(home, folder, CC="/nonexistent/cc"))  # and no runtime build either: both reasons
    assert not marker.exists() and r["loaded"] is None, r
    assert f"chmod go-w {ext}" in r["why"] and "; and /nonexistent/cc failed to run" in r["why"], r["why"]


@pytest.mark.slow
def test_the_installed_extension_comes_first(tmp_path):
    "A trusted extension that agrees is used as it is: no compiler run, nothing written to SHARDKIT_HOME."
    cc = _can_build()
    folder, home = tmp_path / "native", tmp_path / "home"
    folder.mkdir(mode=0o755)
    ext = folder / f"_jpeg_window{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    source = Path(__file__).resolve().parents[1] / "shardkit" / "native" / "jpeg_window.c"
    r = subprocess.run([cc, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-o", str(ext), str(source), "-ljpeg"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = _report(_in_fresh_process(home, folder, CC="/nonexistent/cc"))
    assert r["why"] is None and r["loaded"] == str(ext) and r["warnings"] == [], r
    assert not home.exists(), "nothing built or made in SHARDKIT_HOME"
    r = _report(_in_fresh_process(home, folder, CC="/nonexistent/cc", SHARDKIT_JPEG_WINDOW="build"))
    assert r["loaded"] is None and "/nonexistent/cc failed to run" in r["why"], r  # build: the installed one is skipped
    r = _report(_in_fresh_process(home, folder, SHARDKIT_JPEG_WINDOW="maybe"))
    assert r["loaded"] is None and r["why"] == "SHARDKIT_JPEG_WINDOW='maybe' is none of 1, 0 or build; set one of them", r


@pytest.mark.slow
def test_a_private_home_builds_a_working_decoder_once_for_two_processes(tmp_path):
    cc = _can_build()
    tools = tmp_path / "tools"
    tools.mkdir(mode=0o700)
    log, wrapper = tmp_path / "cc.log", tools / "cc"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {cc} "$@"\n')
    wrapper.chmod(0o700)
    home = tmp_path / "home"
    build = dict(CC=str(wrapper), SHARDKIT_JPEG_WINDOW="build")
    first, second = _in_fresh_process(home, **build), _in_fresh_process(home, **build)
    reports = [_report(first), _report(second)]
    assert [r["why"] for r in reports] == [None, None] and [r["loaded"] for r in reports] == [reports[0]["path"]] * 2, reports
    builds = [l for l in log.read_text().splitlines() if "-shared" in l]
    assert len(builds) == 1, builds
    assert oct(home.stat().st_mode & 0o777) == "0o700" and oct((home / "native").stat().st_mode & 0o777) == "0o700"
    path = Path(reports[0]["path"])
    path.write_bytes(path.read_bytes()[:100])  # a library cut short: removed and built again, once
    assert _report(_in_fresh_process(home, **build))["why"] is None
    assert len([l for l in log.read_text().splitlines() if "-shared" in l]) == 2


ROOT = Path(__file__).resolve().parents[1]
LOADS = textwrap.dedent(r'''
    import json, sys
    from pathlib import Path
    from shardkit.loading import jpeg
    fn, why, path = jpeg._installed_decoder(Path(sys.argv[1]))
    print(json.dumps({"loaded": fn is not None, "why": why, "path": str(path)}))
''')


def _pip_wheel(src, out, env):
    "`pip wheel` of the checkout copied to `src` (from scratch: no build/ left from a previous one) into `out`."
    shutil.rmtree(src / "build", ignore_errors=True)
    for info in src.glob("*.egg-info"): shutil.rmtree(info)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
                       cwd=src, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    wheels = list(out.glob("shardkit-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], r.stdout + r.stderr


@pytest.mark.slow
def test_pip_builds_the_extension_where_it_can_and_installs_without_it_where_it_cannot(tmp_path):
    """Wheels of this checkout, built as `pip install` builds them: with a compiler and libjpeg's headers the wheel holds
    the extension, which exports the one function, is trusted, loads and agrees with torchvision; with a compiler that
    fails (CC=/bin/false) or none on PATH, the wheel still builds, with the C source for the runtime build and no
    extension. The environment's installed shardkit is not touched."""
    _can_build()
    src = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # a file deleted in the working tree is still in the index
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    assert not list((src / "shardkit" / "native").glob("*.so")), "no extension copied in from an editable install"
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CFLAGS", "LDFLAGS", "SHARDKIT_JPEG_WINDOW")}

    wheel, log = _pip_wheel(src, tmp_path / "with-cc", env)
    names = zipfile.ZipFile(wheel).namelist()
    ext = [n for n in names if n.startswith("shardkit/native/_jpeg_window")]
    assert len(ext) == 1 and any(ext[0].endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES), (ext, log[-3000:])
    assert "shardkit/native/jpeg_window.c" in names, "the source ships too, for the runtime build"
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    so = unpacked / ext[0]
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True).stdout
        exported = [l.split()[-1] for l in symbols.splitlines() if l.split()]
        assert exported == ["sk_decode_crop", "sk_decode_rgb_window"], symbols
    r = subprocess.run([sys.executable, "-c", LOADS, str(so.parent)], capture_output=True, text=True, timeout=180,
                       stdin=subprocess.DEVNULL, env={**env, "SHARDKIT_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"loaded": True, "why": None, "path": str(so)}, r.stdout

    bare = tmp_path / "bare-bin"  # a PATH with this Python and no compiler
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    for label, without in [("cc-fails", {"CC": "/bin/false"}), ("no-cc-on-path", {"PATH": str(bare)})]:
        wheel, log = _pip_wheel(src, tmp_path / label, {**env, **without})
        names = zipfile.ZipFile(wheel).namelist()
        assert not [n for n in names if n.startswith("shardkit/native/_jpeg_window")], (label, names)
        assert "shardkit/native/jpeg_window.c" in names and "shardkit/loading/jpeg.py" in names, label
        assert 'building extension "shardkit.native._jpeg_window" failed' in log, (label, log[-3000:])
