"""Carry a model file that is larger than one transfer allows (the GPU machine's calls carry
at most 64 MiB; the SmolLM2 GGUF is 94 MiB) in parts, and put it together on the other side.

    python examples/smollm2/model_parts.py split model.gguf .device/model --part-mib 46
        # -> .device/model/part_000/, part_001/, ... each with one piece and manifest.json
    python examples/smollm2/model_parts.py join .device/model/part_000 --stash /tmp/parts \\
        --output /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
        # one call per part: each call stashes its piece; the call that completes the set
        # checks every piece's and the whole file's SHA-256 and writes the output atomically

``join`` exits 0 while parts are missing (saying which), 1 when a piece or the whole file does
not match the manifest (nothing is written), and prints the output path when done.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split(source: Path, target: Path, part_mib: int) -> list[Path]:
    """``target/part_NNN/`` folders, each holding one piece and the manifest of all."""
    size, step = source.stat().st_size, part_mib << 20
    pieces = []
    with source.open("rb") as f:
        for index in range(max(1, -(-size // step))):
            folder = target / f"part_{index:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            piece = folder / f"{source.name}.{index:03d}"
            piece.write_bytes(f.read(step))
            pieces.append(piece)
    manifest = {
        "name": source.name,
        "size": size,
        "sha256": sha256(source),
        "parts": [{"file": p.name, "sha256": sha256(p)} for p in pieces],
    }
    for piece in pieces:
        (piece.parent / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return [p.parent for p in pieces]


def join(part: Path, stash: Path, output: Path) -> int:
    """Stash ``part``'s piece; assemble ``output`` once every piece is in ``stash``."""
    manifest = json.loads((part / MANIFEST).read_text())
    stash.mkdir(parents=True, exist_ok=True)
    for entry in manifest["parts"]:
        if (part / entry["file"]).is_file():
            shutil.copyfile(part / entry["file"], stash / entry["file"])
    missing = [e["file"] for e in manifest["parts"] if not (stash / e["file"]).is_file()]
    if missing:
        print(f"stashed in {stash}; still to carry: {', '.join(missing)}")
        return 0
    for entry in manifest["parts"]:
        if sha256(stash / entry["file"]) != entry["sha256"]:
            print(
                f"{stash / entry['file']}: SHA-256 differs from the manifest; carry it again",
                file=sys.stderr,
            )
            return 1
    return assemble(manifest, stash, output)


def assemble(manifest: dict, stash: Path, output: Path) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            for entry in manifest["parts"]:
                with (stash / entry["file"]).open("rb") as piece:
                    shutil.copyfileobj(piece, out)
        if sha256(Path(name)) != manifest["sha256"]:
            print(f"the joined file's SHA-256 differs from {manifest['name']}'s", file=sys.stderr)
            return 1
        os.chmod(name, 0o644)
        os.replace(name, output)
    finally:
        if os.path.exists(name):
            os.unlink(name)
    print(output)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="cut a file into part folders")
    cut.add_argument("source", type=Path)
    cut.add_argument("target", type=Path)
    cut.add_argument("--part-mib", type=int, default=46, help="MiB per piece (default 46)")
    glue = sub.add_parser("join", help="stash one part folder; assemble when all are there")
    glue.add_argument("part", type=Path, help="a part_NNN folder made by split")
    glue.add_argument("--stash", type=Path, required=True, help="where pieces wait")
    glue.add_argument("--output", type=Path, required=True, help="the assembled file")
    args = parser.parse_args(argv)
    if args.command == "split":
        if not args.source.is_file():
            parser.error(f"{args.source} is not a file")
        for folder in split(args.source, args.target, args.part_mib):
            print(folder)
        return 0
    if not (args.part / MANIFEST).is_file():
        parser.error(f"{args.part} has no {MANIFEST}: give a part folder made by split")
    return join(args.part, args.stash, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
