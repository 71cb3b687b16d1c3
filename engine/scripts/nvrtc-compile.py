#!/usr/bin/env python3
"""Compiles CUDA C sources to PTX with NVRTC loaded by path (ctypes; no toolkit install).

Usage: nvrtc-compile.py LIBNVRTC ARCH OUTDIR PRELUDE SOURCE...

Each source is compiled as PRELUDE + source, exactly as the engine's CUDA backend does at
start-up (engine/src/backend/cuda/sources.rs), with the same options. Writes
OUTDIR/<name>.ptx; prints NVRTC's log; exits 1 on the first failure.
"""
import ctypes
import pathlib
import sys
import time


def check(lib, prog, status, what, name):
    if status != 0:
        msg = lib.nvrtcGetErrorString(status).decode()
        log = ""
        if prog is not None:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
        sys.exit(f"{name}: {what} failed: {msg}\n{log}")


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    libpath, arch, outdir, prelude = sys.argv[1:5]
    sources = sys.argv[5:]
    lib = ctypes.CDLL(libpath)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"NVRTC {major.value}.{minor.value} from {libpath}, arch {arch}")
    head = pathlib.Path(prelude).read_text()
    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    # Keep in sync with engine/src/backend/cuda/sources.rs::nvrtc_options.
    opts = [f"--gpu-architecture=compute_{arch}", "--std=c++17", "-default-device"]
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    for src in sources:
        name = pathlib.Path(src).name
        text = head + "\n" + pathlib.Path(src).read_text()
        prog = ctypes.c_void_p()
        t0 = time.monotonic()
        check(lib, None, lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None), "create", name)
        status = lib.nvrtcCompileProgram(prog, len(opts), copts)
        check(lib, prog, status, "compile", name)
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        lsize = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(lsize))
        log = ctypes.create_string_buffer(lsize.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        (out / (pathlib.Path(name).stem + ".ptx")).write_bytes(buf.value)
        warn = log.value.decode(errors="replace").strip()
        print(f"  {name}: PTX {size.value} bytes in {time.monotonic() - t0:.2f} s" + (f"\n{warn}" if warn else ""))


main()
