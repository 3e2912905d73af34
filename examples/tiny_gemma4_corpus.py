"""Prepare the training data of the embedded default model (models/rv-gemma4-tiny): public-domain
English from five Debian bookworm packages, a BPE tokenizer, and the token streams.

    python examples/tiny_gemma4_corpus.py --out .train

Writes into --out: train.txt / heldout.txt (one document per line), heldout_sample.txt (the first
~800 characters of each source's held-out part, for CI), tokenizer.json, train.npy / heldout.npy
(uint16 token ids, documents joined by newlines, no BOS) and corpus.json (packages, versions,
.deb sha256s, licences, sizes, the split). Needs `apt-get download` (Debian bookworm sources),
`dpkg -x`, and runs the `bible` program from bible-kjv to decode the KJV text.

Split: the last 1% of each source's characters (cut at a document boundary) is held out, and
both Bibles hold out the same chapters (Revelation 8-22, the KJV's 1%). The sources are in
canonical order, so the commentaries' tails are on the end of Revelation (Henry, Scofield) and
the last Psalms (Spurgeon).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import re
import struct
import subprocess
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids 0, 1, 2, 3
HELDOUT_FRACTION = 0.01
SAMPLE_CHARS = 800  # per source, in heldout_sample.txt
# Both Bibles hold out the same chapters, Revelation 8-22 (the KJV's 1% tail): their first verse.
BIBLE_HELDOUT_FROM = {"kjv": "And when he had opened the seventh seal",
                      "web": "When he opened the seventh seal"}


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str  # of the .deb, as in bookworm's Packages index
    arch: str = "all"


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    package: Package
    licence: str  # as stated in the package's copyright file / module conf
    sword_dir: str | None  # zText/zCom module directory inside the package; None: the KJV


KJV_READER = Package("bible-kjv", "4.38",
                     "75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d", "amd64")
SOURCES = (
    Source("kjv", "King James Version (1611)",
           Package("bible-kjv-text", "4.38",
                   "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"),
           "public domain (copyright file: 'The copyright for the King James Version text of "
           "the Bible is expired')", None),
    Source("web", "World English Bible with Deuterocanon (engWEB2015eb)",
           Package("sword-text-web", "426.0-1",
                   "930b23670b352f0829a306501de4bebb5e654a2df02cde2cbe86b802177868e1"),
           "public domain", "usr/share/sword/modules/texts/ztext/engWEB2015eb"),
    Source("mhcc", "Matthew Henry's Concise Commentary on the Whole Bible",
           Package("sword-comm-mhcc", "2.0-1",
                   "06f748215de78ff48fdfdee93e3ffc5af6318b976485f7aedf22309236967e35"),
           "public domain", "usr/share/sword/modules/comments/zcom/mhcc"),
    Source("tdavid", "C. H. Spurgeon's Treasury of David (1869-1885)",
           Package("sword-comm-tdavid", "2.1-1",
                   "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f"),
           "public domain", "usr/share/sword/modules/comments/zcom/tdavid"),
    Source("scofield", "Scofield Reference Notes (1917)",
           Package("sword-comm-scofield", "2.1-1",
                   "0c11a9533d4870ec40cc72792ecde8aae6e4cc00eca12301150aac018fd5dfcb"),
           "public domain", "usr/share/sword/modules/comments/zcom/scofield"),
)


# --- fetching -----------------------------------------------------------------------------------


def fetch(pkg: Package, debs: Path) -> Path:
    """The package's .deb in `debs` (downloaded with apt-get if absent), its sha256 checked."""
    deb = debs / f"{pkg.name}_{pkg.version}_{pkg.arch}.deb"
    if not deb.exists():
        subprocess.run(["apt-get", "download", f"{pkg.name}={pkg.version}"], cwd=debs,
                       check=True, stderr=subprocess.DEVNULL)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if digest != pkg.sha256:
        raise SystemExit(f"{deb}: sha256 {digest}, expected {pkg.sha256}")
    return deb


def unpack(deb: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg", "-x", str(deb), str(into)], check=True)
    return into


# --- decoding -----------------------------------------------------------------------------------


def kjv_chapters(reader_root: Path, text_root: Path) -> list[str]:
    """One line per chapter: the `bible` program prints 'Ge1:1 In the beginning...' per verse."""
    out = subprocess.run(
        [str(reader_root / "usr/bin/bible"), "-f", "-p", str(text_root / "usr/lib"),
         "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)", line)
        if not m:
            raise SystemExit(f"bible: unexpected line {line[:60]!r}")
        chapters.setdefault(f"{m[1]}{m[2]}", []).append(m[4].strip())
    if sum(map(len, chapters.values())) != 31102:
        raise SystemExit("bible: expected the 31102 verses of the KJV")
    return [" ".join(verses) for verses in chapters.values()]


def sword_entries(module: Path) -> list[str]:
    """The raw OSIS text of every entry of a zText/zCom SWORD module, in canonical order.

    Files per testament (ot, nt): *.?zs block index (offset, size, uncompressed size: 3 x u32),
    *.?zz zlib blocks, *.?zv entry index (block u32, offset u32, size u16 for 'b' files or u32
    for 'c' files). Consecutive entries pointing at the same text (a comment on a verse range)
    are kept once."""
    entries: list[str] = []
    for testament in ("ot", "nt"):
        for letter, entry_fmt in (("b", "<IIH"), ("c", "<III")):
            index = module / f"{testament}.{letter}zs"
            if not index.exists() or index.stat().st_size == 0:
                continue
            data = (module / f"{testament}.{letter}zz").read_bytes()
            blocks = []
            for off, size, usize in struct.iter_unpack("<III", index.read_bytes()):
                blocks.append(zlib.decompress(data[off:off + size])[:usize] if size else b"")
            last = None
            for block, off, size in struct.iter_unpack(
                    entry_fmt, (module / f"{testament}.{letter}zv").read_bytes()):
                if size and (block, off) != last:
                    entries.append(blocks[block][off:off + size].decode("utf-8"))
                    last = (block, off)
    return entries


_INLINE_TAGS = re.compile(r"</?(w|hi|transChange|foreign|divineName|seg|q)\b[^>]*>")
_DROPPED = re.compile(r"<(note|title)\b.*?</\1>", re.S)
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                         "\u00a0": " "})


def osis_to_text(osis: str) -> str:
    """Plain text of one OSIS fragment: footnotes and headings dropped, markup removed."""
    text = _DROPPED.sub(" ", osis)
    text = _INLINE_TAGS.sub("", text)  # word-level markup sits inside words and punctuation
    text = re.sub(r"<[^>]*>", " ", text)
    text = html.unescape(text).translate(_QUOTES)
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r" ([,.;:!?])", r"\1", text)


def sword_documents(module: Path, bible: bool) -> list[str]:
    """Documents of a SWORD module: a Bible's verses grouped by chapter; a commentary's
    entries as they are."""
    docs: list[list[str]] = [[]]
    for osis in sword_entries(module):
        if bible and "<chapter " in osis and "sID=" in osis and docs[-1]:
            docs.append([])
        text = osis_to_text(osis)
        if text:
            docs[-1].append(text)
    return [" ".join(d) for d in docs if d] if bible else [t for d in docs for t in d]


# --- split, tokenizer, tokens ---------------------------------------------------------------------


def split(docs: list[str], heldout_from: str | None) -> tuple[list[str], list[str]]:
    """(train, heldout): heldout starts at the first document that starts with `heldout_from`,
    or (None) is the shortest tail with >= HELDOUT_FRACTION of the characters."""
    if heldout_from is not None:
        starts = [i for i, d in enumerate(docs) if d.startswith(heldout_from)]
        if len(starts) != 1:
            raise SystemExit(f"split: {len(starts)} documents start with {heldout_from!r}")
        return docs[:starts[0]], docs[starts[0]:]
    total = sum(map(len, docs))
    tail, i = 0, len(docs)
    while tail < HELDOUT_FRACTION * total:
        i -= 1
        tail += len(docs[i])
    return docs[:i], docs[i:]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE: special tokens at ids 0-3, the 256 byte symbols next, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise SystemExit(f"tokenizer: {t} has id {tok.token_to_id(t)}, expected {i}")
    return tok


def tokens(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by a newline."""
    ids = [e.ids for e in tok.encode_batch([d + "\n" for d in docs], add_special_tokens=False)]
    return np.fromiter((i for row in ids for i in row), dtype=np.uint16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    out: Path = a.out
    debs = out / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    docs_by_source: dict[str, list[str]] = {}
    for src in SOURCES:
        root = unpack(fetch(src.package, debs), out / "pkg" / src.package.name)
        if src.sword_dir is None:
            reader = unpack(fetch(KJV_READER, debs), out / "pkg" / KJV_READER.name)
            docs_by_source[src.key] = kjv_chapters(reader, root)
        else:
            docs_by_source[src.key] = sword_documents(root / src.sword_dir,
                                                      bible=src.key == "web")
    train_docs, heldout_docs, sample, stats = [], [], [], {}
    for key, docs in docs_by_source.items():
        tr, ho = split(docs, BIBLE_HELDOUT_FROM.get(key))
        train_docs += tr
        heldout_docs += ho
        sample.append(" ".join(ho)[:SAMPLE_CHARS].rsplit(" ", 1)[0])
        stats[key] = {"documents": len(docs), "chars": sum(map(len, docs)),
                      "train_chars": sum(map(len, tr)), "heldout_chars": sum(map(len, ho))}
    tok = train_tokenizer(train_docs)
    train_ids, heldout_ids = tokens(tok, train_docs), tokens(tok, heldout_docs)
    (out / "train.txt").write_text("\n".join(train_docs) + "\n")
    (out / "heldout.txt").write_text("\n".join(heldout_docs) + "\n")
    (out / "heldout_sample.txt").write_text("\n".join(sample) + "\n")
    tok.save(str(out / "tokenizer.json"))
    np.save(out / "train.npy", train_ids)
    np.save(out / "heldout.npy", heldout_ids)
    manifest = {
        "sources": [{**asdict(s), "stats": stats[s.key]} for s in SOURCES],
        "kjv_reader": asdict(KJV_READER),
        "distribution": "Debian bookworm (main), fetched with apt-get download",
        "split": f"last {HELDOUT_FRACTION:.0%} of each source's characters held out",
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_tokens": SPECIAL_TOKENS},
        "train_tokens": int(train_ids.size), "heldout_tokens": int(heldout_ids.size),
        "train_sha256": hashlib.sha256(train_ids.tobytes()).hexdigest(),
    }
    (out / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"train {train_ids.size:,} tokens, heldout {heldout_ids.size:,} tokens, "
          f"vocab {tok.get_vocab_size()} -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
