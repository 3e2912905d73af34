"""Signed artifacts: keys, `sign`, the trust check on open, and every refusal of an unsigned,
wrongly signed or tampered file, through the container, `runtime.load`, `rvcompile` and
`rvrun` (run, ppl, serve)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from rvcompile import runtime
from rvcompile.artifacts import Artifact, ArtifactError, ArtifactHeader, ArtifactWriter
from rvcompile.artifacts.format import (
    ALIGN,
    HEADER_SIZE,
    align_up,
    decode_header_block,
    encode_header_block,
)
from rvcompile.artifacts.signature import (
    MAX_SIGNER,
    KeyFileError,
    Signature,
    TrustedKey,
    encode_page,
    load_signing_key,
    load_trusted_key,
    sign_artifact,
    status,
    write_keypair,
)

BIN = Path(sys.executable).parent
RVCOMPILE, RVRUN = str(BIN / "rvcompile"), str(BIN / "rvrun")
HEADER = ArtifactHeader(compiler_version="0.1.0", target="xla", platforms=("cpu",),
                        requirements={"runtime": "xla"})
PIECE = 64  # bytes per hashed piece of the small artifacts, so their tables have many digests


def small(path: Path, seed: int = 0) -> Path:
    """A container-level artifact (not a model) of three sections; `seed` changes its bytes."""
    rng = np.random.default_rng(seed)
    with ArtifactWriter(path, HEADER, piece_size=PIECE) as w:
        w.add("programs", rng.integers(0, 256, 100, dtype=np.uint8))
        w.add("weights", rng.integers(0, 256, 11 * PIECE + 5, dtype=np.uint8))
        w.add("tokenizer", b'{"vocab": {}}')
        w.commit({"model": {"name": f"small-{seed}"}})
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (private key file, public key file) for alice, bob and carol."""
    d = tmp_path_factory.mktemp("keys")
    return {name: write_keypair(d / name)[:2] for name in ("alice", "bob", "carol")}


def trusted(keys: dict, *names: str) -> list[TrustedKey]:
    return [load_trusted_key(keys[n][1]) for n in names]


def sign(path: Path, keys: dict, name: str, signer: str = "") -> tuple[Signature, ...]:
    return sign_artifact(path, load_signing_key(keys[name][0]), signer)


def refused(path: Path, keys: list[TrustedKey], *needles: str) -> str:
    """Opening `path` with `keys` raises one line naming the file and containing `needles`."""
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path, trusted_keys=keys).close()
    msg = str(e.value)
    assert msg.startswith(f"{path.name}: ") and "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# ---------------------------------------------------------------------------------------------
# Signing and the trust check


def test_sign_and_check_round_trip(tmp_path: Path, keys) -> None:
    path = small(tmp_path / "a.rvp")
    before = path.read_bytes()
    with Artifact.open(path) as art:
        assert art.signatures == ()
        page_offset = art.signable.page_offset
    assert page_offset == align_up(len(before))

    (sig,) = sign(path, keys, "alice", "Alice Release")
    after = path.read_bytes()
    assert after[: len(before)] == before  # signing rewrites nothing but the page after the end
    assert len(after) == page_offset + ALIGN
    with Artifact.open(path, trusted_keys=trusted(keys, "alice")) as art:
        assert art.signatures == (sig,)
        assert sig.signer == "Alice Release"
        assert sig.key_id == load_trusted_key(keys["alice"][1]).key_id
        art.verify()
    with Artifact.open(path) as art:  # without trusted keys: read, not checked
        assert art.signatures == (sig,)

    # A second signer adds a signature; the same key again replaces its own, not the other's.
    sign(path, keys, "bob")
    sigs = sign(path, keys, "alice", "Alice again")
    assert [(s.signer, s.key_id) for s in sigs] == [
        ("", load_trusted_key(keys["bob"][1]).key_id),
        ("Alice again", sig.key_id),
    ]
    assert path.read_bytes()[: len(before)] == before
    for names in (("alice",), ("bob",), ("carol", "bob"), ("alice", "bob")):
        Artifact.open(path, trusted_keys=trusted(keys, *names)).close()


def test_unsigned_refused(tmp_path: Path, keys) -> None:
    path = small(tmp_path / "u.rvp")
    refused(path, trusted(keys, "alice"), "not signed", "trusted key is required")
    refused(path, [], "no trusted keys given")
    Artifact.open(path).close()  # without trusted keys an unsigned file opens as before


def test_wrong_key_refused(tmp_path: Path, keys) -> None:
    path = small(tmp_path / "w.rvp")
    sign(path, keys, "alice", "Alice")
    alice, carol = trusted(keys, "alice", "carol")
    msg = refused(path, [carol], f"signed only by Alice (key {alice.key_id}), not by a trusted "
                  f"key ({carol.key_id} from {keys['carol'][1]})")
    assert msg.count(alice.key_id) == 1


def test_signature_copied_from_another_artifact_refused(tmp_path: Path, keys) -> None:
    a, b = small(tmp_path / "a.rvp", seed=1), small(tmp_path / "b.rvp", seed=2)
    for p in (a, b):
        sign(p, keys, "alice")
    data_a, data_b = a.read_bytes(), b.read_bytes()
    with Artifact.open(a) as art_a, Artifact.open(b) as art_b:
        at_a, at_b = art_a.signable.page_offset, art_b.signable.page_offset
    a.write_bytes(data_a[:at_a] + data_b[at_b:])  # b's well-formed page, a's everything else
    refused(a, trusted(keys, "alice"), "the signature by key ", "does not match this artifact")


def test_signer_name_is_signed(tmp_path: Path, keys) -> None:
    """A page rewritten with another signer name (and a fresh checksum) no longer verifies."""
    path = small(tmp_path / "n.rvp")
    (sig,) = sign(path, keys, "alice", "Alice")
    with Artifact.open(path) as art:
        at = art.signable.page_offset
    forged = Signature(sig.key_id, "Mallory", sig.ed25519)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(encode_page([forged], path.name))
    refused(path, trusted(keys, "alice"), "signature by Mallory (key", "does not match")


def test_an_invalid_trusted_signature_is_refused_beside_a_valid_one(tmp_path: Path,
                                                                   keys) -> None:
    """Every signature by a trusted key must hold, not just one of them."""
    path = small(tmp_path / "two.rvp")
    sign(path, keys, "alice")
    (alice_sig, bob_sig) = sign(path, keys, "bob")
    with Artifact.open(path) as art:
        at = art.signable.page_offset
    bad = Signature(bob_sig.key_id, bob_sig.signer, bytes(64))
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(encode_page([alice_sig, bad], path.name))
    with Artifact.open(path, trusted_keys=trusted(keys, "alice")) as art:  # bob's unchecked
        statuses = [status(s, art.signable, trusted(keys, "alice", "bob"))
                    for s in art.signatures]
        assert statuses == ["valid", "INVALID"]
        assert status(bad, art.signable, trusted(keys, "alice")) == "not checked"
    refused(path, trusted(keys, "alice", "bob"), "signature by key ", "does not match")


def _regions(path: Path) -> list[tuple[str, int, int]]:
    """(label, start, end) covering every byte of a signed file, in order."""
    data = path.read_bytes()
    layout = decode_header_block(data[:HEADER_SIZE], path.name)
    json_end = 48 + int.from_bytes(data[12:16], "little")
    table, manifest = layout.piece_digests, layout.manifest
    named = [("header json", 0, json_end), ("header padding", json_end, HEADER_SIZE),
             *((f"section {s.name}", s.offset, s.offset + s.size) for s in layout.sections),
             ("table", table.offset, table.offset + table.size),
             ("manifest", manifest.offset, manifest.offset + manifest.size)]
    page = align_up(named[-1][2])
    named.append(("signature page", page, page + ALIGN))
    out, end = [], 0
    for label, start, stop in named:
        if start > end:
            out.append((f"padding before {label}", end, start))
        out.append((label, start, stop))
        end = stop
    assert end == len(data)
    return out


def test_every_single_byte_flip_is_refused(tmp_path: Path, keys) -> None:
    """A bit flipped anywhere in a signed file (every byte of the small regions, a seeded sample
    of the large ones) is refused on open with the trusted key, or, inside a section, by the
    verify that loading runs next."""
    path = small(tmp_path / "f.rvp")
    sign(path, keys, "alice", "Alice")
    good = path.read_bytes()
    key = trusted(keys, "alice")
    rng = np.random.default_rng(0)
    checked = 0
    with open(path, "r+b") as f:
        for label, start, end in _regions(path):
            offsets = range(start, end)
            if len(offsets) > 300:
                offsets = sorted(rng.choice(offsets, 300, replace=False).tolist())
            for at in offsets:
                f.seek(at)
                f.write(bytes([good[at] ^ (1 << int(rng.integers(8)))]))
                f.flush()
                with pytest.raises(ArtifactError) as e:
                    with Artifact.open(path, trusted_keys=key) as art:
                        assert label.startswith("section"), (label, at)  # refused at open
                        art.verify()
                assert "\n" not in str(e.value)
                f.seek(at)
                f.write(good[at : at + 1])
                f.flush()
                checked += 1
    assert path.read_bytes() == good
    assert checked > 2000
    Artifact.open(path, trusted_keys=key).close()


def tamper_consistently(path: Path) -> None:
    """Flip the first weight byte and re-compute its piece digest, the table's sha256 and the
    header checksum: every hash agrees with the new bytes."""
    data = bytearray(path.read_bytes())
    layout = decode_header_block(bytes(data[:HEADER_SIZE]), path.name)
    weights = next(s for s in layout.sections if s.name == "weights")
    piece = layout.piece_size
    data[weights.offset] ^= 1
    index = sum(-(-s.size // piece) for s in layout.sections[:layout.sections.index(weights)])
    t = layout.piece_digests
    at = t.offset + 32 * index
    first = data[weights.offset : weights.offset + min(piece, weights.size)]
    data[at : at + 32] = hashlib.sha256(first).digest()
    table_sha = hashlib.sha256(data[t.offset : t.offset + t.size]).hexdigest()
    blob = dataclasses.replace(t, sha256=table_sha)
    data[:HEADER_SIZE] = encode_header_block(dataclasses.replace(layout, piece_digests=blob), "x")
    path.write_bytes(bytes(data))


def test_consistent_tampering_is_caught_only_by_the_signature(tmp_path: Path, keys) -> None:
    """Hashes detect accidents, signatures detect tampering: a weight byte changed with its
    piece digest, the table's sha256 and the header checksum all re-computed verifies clean,
    and is refused with the trusted key."""
    path = small(tmp_path / "evil.rvp")
    sign(path, keys, "alice", "Alice")
    tamper_consistently(path)
    with Artifact.open(path) as art:
        art.verify()  # consistent: no hash can tell
        assert art.signatures[0].signer == "Alice"
    refused(path, trusted(keys, "alice"), "the signature by Alice (key ", "does not match")


def test_torn_or_trailing_page_is_refused_with_a_way_out(tmp_path: Path, keys) -> None:
    path = small(tmp_path / "t.rvp")
    unsigned_size = path.stat().st_size
    sign(path, keys, "alice")
    with Artifact.open(path) as art:
        at = art.signable.page_offset
    data = path.read_bytes()
    path.write_bytes(data[: at + 100] + bytes(ALIGN - 100))  # the page's tail never written
    with pytest.raises(ArtifactError, match=rf"signature page is corrupt .*`truncate -s "
                                            rf"{unsigned_size}` drops the page, then sign again"):
        Artifact.open(path)
    os.truncate(path, unsigned_size)
    with Artifact.open(path) as art:
        assert art.signatures == ()
    path.write_bytes(data + b"x")
    extra = len(data) + 1 - unsigned_size
    with pytest.raises(ArtifactError, match=rf"^t\.rvp: {extra} unexpected bytes after the "
                                            rf"manifest \(a signature page is {ALIGN} bytes"):
        Artifact.open(path)


def test_too_many_signatures_leave_the_file_as_it_was(tmp_path: Path) -> None:
    path = small(tmp_path / "many.rvp")
    signed = 0
    with pytest.raises(ArtifactError, match=r"signatures do not fit the 4096-byte signature"):
        for _ in range(40):
            sign_artifact(path, ed25519.Ed25519PrivateKey.generate(), "x" * MAX_SIGNER)
            signed += 1
    assert signed >= 8
    with Artifact.open(path) as art:
        assert len(art.signatures) == signed


def test_signing_does_not_hash_sections(tmp_path: Path, keys) -> None:
    """Sign trusts the digest table as it is: a section corrupted before signing still fails
    the verify that loading runs."""
    path = small(tmp_path / "s.rvp")
    with Artifact.open(path) as art:
        at = art.sections["weights"].offset + 7
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" if path.read_bytes()[at] != 0xFF else b"\0")
    sign(path, keys, "alice")
    with Artifact.open(path, trusted_keys=trusted(keys, "alice")) as art:
        with pytest.raises(ArtifactError, match=r"section 'weights' is corrupt"):
            art.verify()


# ---------------------------------------------------------------------------------------------
# Key files


def test_keygen_writes_pem_keys_with_modes(tmp_path: Path) -> None:
    private, public, kid = write_keypair(tmp_path / "k")
    assert (private.name, public.name) == ("k.key", "k.pub")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    pub = load_trusted_key(public)
    assert pub.key_id == kid == hashlib.sha256(
        load_signing_key(private).public_key().public_bytes(serialization.Encoding.Raw,
                                                            serialization.PublicFormat.Raw)
    ).hexdigest()
    with pytest.raises(KeyFileError, match=r"k\.key: already exists"):
        write_keypair(tmp_path / "k")
    public.unlink()
    with pytest.raises(KeyFileError, match=r"k\.key: already exists"):
        write_keypair(tmp_path / "k")  # neither file is replaced, even when one is missing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.key"]
    with pytest.raises(KeyFileError, match=r"cannot write key file"):
        write_keypair(tmp_path / "missing-dir" / "k")


def test_bad_key_files_are_one_line_errors(tmp_path: Path, keys) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a key\n")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    rsa_private, rsa_public = tmp_path / "rsa.key", tmp_path / "rsa.pub"
    rsa_private.write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM,
                                                  serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    rsa_public.write_bytes(rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret")))
    private, public = keys["alice"]
    cases = [
        (load_signing_key, tmp_path / "none.key", "cannot read key file"),
        (load_signing_key, garbage, "not a PEM private key"),
        (load_signing_key, public, "this is a public key"),
        (load_signing_key, rsa_private, "RSAPrivateKey, not an Ed25519 private key"),
        (load_signing_key, encrypted, "the private key is encrypted"),
        (load_trusted_key, tmp_path / "none.pub", "cannot read key file"),
        (load_trusted_key, garbage, "not a PEM public key"),
        (load_trusted_key, private, "this is a private key"),
        (load_trusted_key, rsa_public, "RSAPublicKey, not an Ed25519 public key"),
    ]
    for load, path, needle in cases:
        with pytest.raises(KeyFileError) as e:
            load(path)
        msg = str(e.value)
        assert msg.startswith(f"{path}: ") and needle in msg and "\n" not in msg, msg


def test_signer_names_are_checked(tmp_path: Path, keys) -> None:
    path = small(tmp_path / "n.rvp")
    for bad in ("two\nlines", "\x1b[31mred", "rtl\u202etxt", "x" * (MAX_SIGNER + 1)):
        with pytest.raises(ArtifactError, match=r"^n\.rvp: signer name .* printable"):
            sign(path, keys, "alice", bad)
    with Artifact.open(path) as art:
        assert art.signatures == ()
    (sig,) = sign(path, keys, "alice", "Zoë Ō")
    with Artifact.open(path, trusted_keys=trusted(keys, "alice")) as art:
        assert art.signatures[0].signer == sig.signer == "Zoë Ō"


# ---------------------------------------------------------------------------------------------
# runtime.load: refused before anything past the header block and digest table is read


def test_load_refuses_before_reading_the_manifest(tmp_path: Path, keys) -> None:
    """An unsigned file whose manifest is corrupt, and a wrongly signed one whose manifest is no
    model's: the refusal names the signature, so nothing past it was read."""
    unsigned = small(tmp_path / "u.rvp")
    data = bytearray(unsigned.read_bytes())
    data[-3] ^= 1  # inside the manifest JSON
    unsigned.write_bytes(bytes(data))
    pub = str(keys["alice"][1])
    with pytest.raises(ArtifactError, match=r"^u\.rvp: not signed"):
        runtime.load(unsigned, trusted_keys=[pub])
    wrong = small(tmp_path / "w.rvp")
    sign(wrong, keys, "bob")
    with pytest.raises(ArtifactError, match=r"^w\.rvp: signed only by key "):
        runtime.load(wrong, trusted_keys=trusted(keys, "alice"))
    with pytest.raises(ArtifactError, match=r"^w\.rvp: trusted_keys needs verify"):
        runtime.load(wrong, verify=False, trusted_keys=[pub])
    with pytest.raises(KeyFileError, match=r"garbage: cannot read key file"):
        runtime.load(wrong, trusted_keys=[str(tmp_path / "garbage")])


# ---------------------------------------------------------------------------------------------
# The command lines


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def one_error_line(p: subprocess.CompletedProcess, prog: str, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_rvrun_refusals_are_one_line_exit_2(tmp_path: Path, keys) -> None:
    unsigned = small(tmp_path / "u.rvp")
    wrong = small(tmp_path / "w.rvp")
    sign(wrong, keys, "bob", "Bob")
    alice_pub, alice_key = str(keys["alice"][1]), str(keys["alice"][0])
    text = tmp_path / "t.txt"
    text.write_text("In the beginning")
    commands = {
        "run": [RVRUN, "{art}", "--prompt", "hi"],
        "ppl": [RVRUN, "ppl", "{art}", "--text", str(text)],
        "serve": [RVRUN, "serve", "{art}", "--port", "0"],
    }
    for cmd in commands.values():
        def go(art: Path, *flags: str, cmd=cmd) -> subprocess.CompletedProcess:
            return run(*[str(art) if c == "{art}" else c for c in cmd], *flags)

        one_error_line(go(unsigned, "--trusted-key", alice_pub), "rvrun",
                       "u.rvp: not signed")
        one_error_line(go(wrong, "--trusted-key", alice_pub), "rvrun",
                       "w.rvp: signed only by Bob (key ", "not by a trusted key")
        one_error_line(go(wrong, "--trusted-key", alice_key), "rvrun",
                       "alice.key: not a PEM public key (this is a private key")
        one_error_line(go(wrong, "--trusted-key", alice_pub, "--no-verify"), "rvrun",
                       "--trusted-key needs the sections verified")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny model as test_serve builds it (so the XLA compile cache is shared)."""
    from rvcompile.build import BuildOptions, build_artifact

    out = tmp_path_factory.mktemp("signed") / "tiny.rvp"
    build_artifact("gemma-4-tiny", out, BuildOptions("tpu-bf16", max_context=128,
                                                     prefill_buckets=(8, 32), max_seqs=4,
                                                     platforms=("cpu",)),
                   random_weights=True, progress=False, log=lambda *a: None)
    return out


def test_cli_keygen_sign_inspect_verify_and_run(tmp_path: Path, tiny: Path) -> None:
    art = tmp_path / "tiny.rvp"
    shutil.copyfile(tiny, art)
    p = run(RVCOMPILE, "keygen", "--out", str(tmp_path / "rel"))
    assert p.returncode == 0, p.stderr
    private, public = tmp_path / "rel.key", tmp_path / "rel.pub"
    kid = load_trusted_key(public).key_id
    assert kid in p.stdout
    one_error_line(run(RVCOMPILE, "keygen", "--out", str(tmp_path / "rel")), "rvcompile",
                   "rel.key: already exists")
    other = write_keypair(tmp_path / "other")[1]

    p = run(RVCOMPILE, "inspect", str(art))
    assert "signatures:      none (unsigned)" in p.stdout
    one_error_line(run(RVCOMPILE, "verify", str(art), "--trusted-key", str(public)),
                   "rvcompile", "tiny.rvp: not signed")

    p = run(RVCOMPILE, "sign", str(art), "--key", str(private), "--signer", "Release Bot")
    assert p.returncode == 0, p.stderr
    assert f"signed by Release Bot (key {kid}) (1 signature)" in p.stdout
    one_error_line(run(RVCOMPILE, "sign", str(art), "--key", str(public)), "rvcompile",
                   "rel.pub: not a PEM private key")
    one_error_line(run(RVCOMPILE, "sign", str(art), "--key", str(private), "--signer", "a\tb"),
                   "rvcompile", "signer name")

    p = run(RVCOMPILE, "inspect", str(art))
    assert f"  signed by Release Bot (key {kid}), not checked" in p.stdout.splitlines()
    p = run(RVCOMPILE, "inspect", str(art), "--trusted-key", str(public))
    assert f"  signed by Release Bot (key {kid}), valid" in p.stdout.splitlines()
    p = run(RVCOMPILE, "inspect", str(art), "--json", "--trusted-key", str(other))
    assert '"status": "not checked"' in p.stdout and '"signer": "Release Bot"' in p.stdout

    p = run(RVCOMPILE, "verify", str(art), "--trusted-key", str(other), "--trusted-key",
            str(public))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == (f"{art}: OK (5 sections; signed by Release Bot (key {kid}), "
                                "valid)")
    one_error_line(run(RVCOMPILE, "verify", str(art), "--trusted-key", str(other)),
                   "rvcompile", "not by a trusted key")

    p = run(RVRUN, str(art), "--prompt", "Hello", "--max-tokens", "4", "--ignore-eos",
            "--trusted-key", str(other), "--trusted-key", str(public))
    assert p.returncode == 0, p.stderr
    assert "[rvrun] load" in p.stderr

    tampered = tmp_path / "tampered.rvp"
    shutil.copyfile(art, tampered)
    tamper_consistently(tampered)  # no hash can tell; the signature does
    assert run(RVCOMPILE, "verify", str(tampered)).returncode == 0
    one_error_line(run(RVRUN, str(tampered), "--prompt", "Hello", "--trusted-key", str(public)),
                   "rvrun", "tampered.rvp: the signature by Release Bot (key ", "does not match")
