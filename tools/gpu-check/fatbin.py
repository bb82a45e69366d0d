#!/usr/bin/env python3
"""Cuts a CUDA library's device code down to what one GPU architecture loads.

NCCL's wheels carry a cubin for every GPU generation (sm_50 ... sm_120) in
their `.nv_fatbin` and `__nv_relfatbin` sections: 250-450 MiB a library, far
more than a device run carries. CUDA's own nvprune does not take shared
libraries, so this does the same for them, in place:

  fatbin.py list LIB            what each fat binary holds, by kind and arch
  fatbin.py prune LIB OUT ARCH  keep, in every fat binary, only what a GPU of
                                compute capability ARCH (e.g. 90) would load

What a GPU of ARCH loads from a fat binary, and so what `prune` keeps: its
cubins (same major version, minor not above ARCH's); where there are none,
the newest PTX not above ARCH, which the driver compiles at load time. The
kept entries move to the front of their fat binary, its header's size shrinks
to them, and the bytes freed become zeros: no address in the library changes
(the host code registers each fat binary by its address), and the zeros
vanish when the staged directory is compressed. An entry's bytes are copied
unchanged, compressed or not.

The layout read here (fat binary header: magic 0xBA55ED50, u16 version, u16
header size, u64 size of its entries; entry header: u16 kind (1 PTX, 2 ELF),
u16, u32 header size, u64 payload size, ..., u32 arch at byte 28) is CUDA's
documented-by-use format that cuobjdump reads; the tests check the result
with cuobjdump itself.
"""

import struct
import sys

MAGIC = 0xBA55ED50
SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")
KINDS = {1: "ptx", 2: "elf"}


class Bad(Exception):
    pass


def sections(data):
    """(name, file offset, size) of the fat binary sections of an ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise Bad("not a little-endian 64-bit ELF file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0 or shstrndx >= shnum:
        raise Bad("no section headers")

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    strtab = header(shstrndx)[4]
    found = []
    for i in range(shnum):
        name_off, kind, _, _, off, size = header(i)[:6]
        name = data[strtab + name_off : data.index(b"\0", strtab + name_off)]
        if name in SECTIONS and kind != 8:  # 8: SHT_NOBITS
            found.append((name.decode(), off, size))
    return found


def containers(data, off, size):
    """Every fat binary in a section: (offset, end, [(entry offset, kind, arch, length)])."""
    end = off + size
    p = off
    while p + 16 <= end:
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, p)
        if magic != MAGIC:
            p += 8  # fat binaries are 8-byte aligned, zero padding between them
            continue
        first = p + hsize
        last = first + fsize
        if last > end:
            raise Bad(f"fat binary at {p:#x} runs past its section")
        entries = []
        q = first
        while q < last:
            kind, _, ehsize, payload = struct.unpack_from("<HHIQ", data, q)
            if ehsize < 32 or q + ehsize + payload > last:
                raise Bad(f"entry at {q:#x} of fat binary {p:#x} is malformed")
            arch = struct.unpack_from("<I", data, q + 28)[0]
            entries.append((q, kind, arch, ehsize + payload))
            q += ehsize + payload
        yield p, hsize, last, entries
        p = (last + 7) & ~7


def wanted(entries, arch):
    """The entries a GPU of compute capability `arch` would load."""
    major = arch // 10
    cubins = [e for e in entries if e[1] == 2 and e[2] // 10 == major and e[2] <= arch]
    if cubins:
        return cubins
    ptx = [e for e in entries if e[1] == 1 and e[2] <= arch]
    if not ptx:
        return []
    newest = max(e[2] for e in ptx)
    return [e for e in ptx if e[2] == newest]


def prune(data, arch):
    """Prunes `data` (a bytearray) in place; returns (kept, dropped) entry counts."""
    kept = dropped = 0
    for _, off, size in sections(data):
        for start, hsize, last, entries in list(containers(data, off, size)):
            keep = wanted(entries, arch)
            body = b"".join(bytes(data[q : q + n]) for q, _, _, n in keep)
            first = start + hsize
            data[first : first + len(body)] = body
            data[first + len(body) : last] = bytes(last - first - len(body))
            struct.pack_into("<Q", data, start + 8, len(body))
            kept += len(keep)
            dropped += len(entries) - len(keep)
    return kept, dropped


def listing(data):
    counts = {}
    for name, off, size in sections(data):
        for _, _, _, entries in containers(data, off, size):
            for _, kind, arch, n in entries:
                key = (name, KINDS.get(kind, str(kind)), arch)
                c, b = counts.get(key, (0, 0))
                counts[key] = (c + 1, b + n)
    return counts


def main(argv):
    try:
        if len(argv) == 3 and argv[1] == "list":
            with open(argv[2], "rb") as f:
                data = f.read()
            for (name, kind, arch), (c, b) in sorted(listing(data).items()):
                print(f"{name} {kind} sm_{arch} entries={c} bytes={b}")
            return 0
        if len(argv) == 5 and argv[1] == "prune":
            arch = int(argv[4])
            with open(argv[2], "rb") as f:
                data = bytearray(f.read())
            kept, dropped = prune(data, arch)
            if kept == 0:
                raise Bad(f"nothing in it loads on sm_{arch}")
            with open(argv[3], "wb") as f:
                f.write(data)
            print(f"fatbin: {argv[2]}: kept {kept} entries for sm_{arch}, dropped {dropped}")
            return 0
    except (Bad, OSError, ValueError, struct.error) as e:
        print(f"fatbin: {argv[2] if len(argv) > 2 else ''}: {e}", file=sys.stderr)
        return 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
