#!/usr/bin/env python3
"""Derives the names a real driver exports from NVIDIA's headers: one name a line, sorted.

    derive-names.py cuda CUDA_INCLUDE_DIR > cuda.names   # cuda.h + cudaTypedefs.h (CUDA 12.8+) and the GL,
                                                         # EGL, VDPAU and profiler headers:
                                                         # "symbol base-name version flavour"
    derive-names.py nvml NVML_H > nvml.names             # nvml.h (NVIDIA/go-nvml, gen/nvml/nvml.h)

Each line starts with the exported name. A name is exported when the header declares a function
under it, or (cuda.h) maps a public name to it (`#define cuMemAlloc cuMemAlloc_v2`,
`__CUDA_API_PTDS(...)`); the headers' legacy sections declare the unversioned names a driver still
exports (nvml.h: `nvmlInit` beside `nvmlInit_v2`). For CUDA every
`PFN_<base>_v<version>[_ptds|_ptsz]` typedef of cudaTypedefs.h is an export too: the n-th version
of a base name is `<base>`, `<base>_v2`, ...; a per-thread flavour is the version it extends plus
`_ptds`/`_ptsz`. Only names are taken from the headers (facts about the ABI), nothing else.
"""
import re
import sys


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def declared(text, prefix, marker):
    """Functions declared `... MARKER [type words] name(` (nvml.h: `const DECLDIR char* nvmlErrorString(`)."""
    return set(re.findall(r"\b%s[\s\w\*]*?\b(%s\w+)\s*\(" % (marker, prefix), text))


def macro_targets(text, prefix):
    out = set()
    for name, value in re.findall(r"#\s*define\s+(%s\w+)\s+([^\n]+)" % prefix, text):
        m = re.fullmatch(r"__CUDA_API_PT(DS|SZ)\((\w+)\)", value.strip())
        if m:
            out.add(m.group(2))
            out.add(m.group(2) + "_pt" + m.group(1).lower())
        elif re.fullmatch(r"%s\w+" % prefix, value.strip()):
            out.add(value.strip())
    return out


def typedef_symbols(text):
    """Each exported symbol a typedef names, with (base name, version, flavour)."""
    out = {}
    for base in sorted(set(re.findall(r"\bPFN_(cu\w+?)_v\d{4,}", text))):
        plain = sorted(plain_versions(text, base))
        for i, version in enumerate(plain):
            out[base if i == 0 else "%s_v%d" % (base, i + 1)] = (base, version, "No")
        for version, pt in re.findall(r"\bPFN_%s_v(\d{4,})(_ptds|_ptsz)\b" % re.escape(base), text):
            n = len([v for v in plain if v <= int(version)])
            symbol = (base if n <= 1 else "%s_v%d" % (base, n)) + pt
            out[symbol] = (base, int(version), "Ptds" if pt == "_ptds" else "Ptsz")
    return out


def plain_versions(text, base):
    return {int(v) for v in re.findall(r"\bPFN_%s_v(\d{4,})\b(?!_pt)" % re.escape(base), text)}


# The driver's headers (cudaProfiler.h is not in the runtime wheel; its typedefs are).
HEADERS = ["cuda.h", "cudaGL.h", "cudaEGL.h", "cudaVDPAU.h"]
TYPEDEFS = ["cudaTypedefs.h", "cudaGLTypedefs.h", "cudaEGLTypedefs.h", "cudaVDPAUTypedefs.h", "cudaProfilerTypedefs.h"]


def read(include, header):
    return open(include + "/" + header).read()


def cuda(include):
    head = "".join(strip_comments(read(include, h)) for h in HEADERS)
    entries = typedef_symbols("".join(strip_comments(read(include, h)) for h in TYPEDEFS))
    for name in declared(head, "cu", "CUDAAPI") | macro_targets(head, "cu"):
        if name in entries:
            continue
        # A flavour the header declares without a typedef: it extends the version it names.
        m = re.fullmatch(r"(\w+)_(ptds|ptsz)", name)
        if not m or m.group(1) not in entries:
            sys.exit("cuda.h declares %s, which no typedef versions; extend derive-names.py" % name)
        base, version, _ = entries[m.group(1)]
        entries[name] = (base, version, m.group(2).capitalize())
    return ["%s %s %d %s" % (s, *entries[s]) for s in entries]


def nvml(path):
    head = strip_comments(open(path).read())
    # Only declared functions: nvml.h also #defines constants to nvml-prefixed names.
    return declared(head, "nvml", "DECLDIR")


def main():
    kind, source = sys.argv[1], sys.argv[2]
    names = cuda(source) if kind == "cuda" else nvml(source)
    sys.stdout.write("".join(n + "\n" for n in sorted(names)))


if __name__ == "__main__":
    main()
