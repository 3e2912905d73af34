"""Ed25519 signatures of .rvp files: key files, the signed message, the signature page, the
trust check, and signing a file in place.

Hashes detect accidents; signatures detect tampering. A signature signs `Signable.message`:

    MESSAGE_TAG | key id (32 raw bytes) | uint32 length + UTF-8 signer name |
    the header block (all HEADER_SIZE bytes, verbatim) | the piece-digest table (verbatim)

The header block holds the format version and the checksummed header JSON: compiler version,
target, platforms, requirements, the section table, the piece size, and the place and sha256 of
the digest table and of the manifest. The table holds the sha256 of every piece of every
section. So one signature binds every byte that determines behaviour: the header directly, the
manifest through its sha256, the sections through their piece digests (which `verify` checks),
and the signer's own id and name; `Artifact.open` requires the padding between regions to be
zero, so no byte of a signed file can change without being refused. Signing hashes only the
header block and the table, never the sections: it takes milliseconds for a file of any size.

The signatures live in one page after the manifest (layout in `format.py`). `sign_artifact`
rewrites only that page, with one page-aligned write of ALIGN bytes and an fsync, under an
exclusive flock (two signers at once would lose one signature): the header, sections, table and
manifest are never rewritten, so no crash can damage the model. A killed process leaves the old
page or the new one (a write of one page to a regular file is not torn by a signal). Only a
power loss on a device that tears 4 KiB writes can leave a half-written page; its sha256 then
refuses it, and the message says how to drop it (truncate the file where the page starts) and
sign again. Copying the file to a temp file and renaming it would also survive that, at the cost
of rewriting the whole file (30 GB) and twice its disk space; we chose the page write.

Key files are PEM: a private key as PKCS#8 (`BEGIN PRIVATE KEY`), written with mode 0600, and a
public key as SubjectPublicKeyInfo (`BEGIN PUBLIC KEY`), as `write_keypair` (`rvcompile keygen`)
writes them and as `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` do. A key's
id is the hex sha256 of its raw 32-byte public key. Encrypted private keys are refused.

Errors are ArtifactError (KeyFileError for key files), one line naming the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )
# cryptography itself is imported by the functions that sign or check: an unsigned load
# (every rvrun without --trusted-key) does not pay its import.

from rvcompile.artifacts.format import ALIGN, ArtifactError, canonical_json

# Domain separation: these bytes can never be mistaken for another protocol's signed message.
MESSAGE_TAG = b"rvcompile .rvp ed25519 signature v1\0"
SIGNATURE_MAGIC = b"\x89RVPSIG\n"
_PAGE_PREFIX = struct.Struct("<8sI32s")  # magic, JSON length, sha256 of the JSON
MAX_SIGNER = 128  # characters of a signer name
_SIG_SIZE = 64  # bytes of an Ed25519 signature


class KeyFileError(ArtifactError):
    """A key file that cannot be read or is not the expected Ed25519 PEM key."""


@dataclass(frozen=True)
class TrustedKey:
    """A public key a reader accepts signatures by."""

    key_id: str  # hex sha256 of the raw public key
    public: Ed25519PublicKey
    source: str  # the file it was read from, for messages


@dataclass(frozen=True)
class Signature:
    """One entry of a signature page."""

    key_id: str  # hex sha256 of the signer's raw public key
    signer: str  # a name the signer chose (`--signer`), may be empty; signed too
    ed25519: bytes  # the 64-byte signature of `Signable.message(key_id, signer)`

    def who(self) -> str:
        return f"{self.signer} (key {self.key_id})" if self.signer else f"key {self.key_id}"


@dataclass(frozen=True)
class Signable:
    """What signatures of one file sign, and where its signature page is (or would go)."""

    header_block: bytes  # the first HEADER_SIZE bytes, verbatim
    table: bytes  # the piece-digest table, verbatim
    page_offset: int  # the first multiple of ALIGN at or after the manifest's end

    def message(self, key_id: str, signer: str) -> bytes:
        name = signer.encode("utf-8")
        return b"".join((MESSAGE_TAG, bytes.fromhex(key_id), struct.pack("<I", len(name)), name,
                         self.header_block, self.table))

    def is_valid(self, sig: Signature, key: TrustedKey) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            key.public.verify(sig.ed25519, self.message(sig.key_id, sig.signer))
        except InvalidSignature:
            return False
        return True


def key_id(public: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def load_signing_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 private key in PEM file `path`."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    name = str(path)
    data = _read_key_file(name)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as e:  # cryptography's way of saying "encrypted, and no password given"
        raise KeyFileError(f"{name}: the private key is encrypted; rvcompile reads unencrypted "
                           "PEM keys (decrypt it with `openssl pkey -in KEY -out PLAIN`)") from e
    except (ValueError, UnsupportedAlgorithm) as e:
        hint = " (this is a public key; sign with the private one)" if b"PUBLIC KEY" in data else ""
        raise KeyFileError(f"{name}: not a PEM private key{hint}") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{name}: {type(key).__name__}, not an Ed25519 private key")
    return key


def load_trusted_key(path: str | os.PathLike[str]) -> TrustedKey:
    """The Ed25519 public key in PEM file `path`."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    name = str(path)
    data = _read_key_file(name)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        hint = " (this is a private key; trust the public one)" if b"PRIVATE KEY" in data else ""
        raise KeyFileError(f"{name}: not a PEM public key{hint}") from e
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{name}: {type(key).__name__}, not an Ed25519 public key")
    return TrustedKey(key_id(key), key, name)


def write_keypair(prefix: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Writes a new key pair as PREFIX.key (private, mode 0600) and PREFIX.pub; returns their
    paths and the key id. Refuses to replace either file; leaves neither on failure."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private_path, public_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (private_path, public_path):
        if p.exists():
            raise KeyFileError(f"{p}: already exists; not replacing a key")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(private_path, private_pem, 0o600)
    try:
        _write_new(public_path, public_pem, 0o644)
    except BaseException:
        private_path.unlink()
        raise
    return private_path, public_path, key_id(key.public_key())


def check_signer(signer: str) -> str:
    """`signer` if it is a name inspect can print safely; ValueError otherwise."""
    if len(signer) > MAX_SIGNER or not signer.isprintable():
        raise ValueError(f"signer name {signer[:MAX_SIGNER]!r} must be at most {MAX_SIGNER} "
                         "printable characters (no control or format characters)")
    return signer


def encode_page(signatures: Sequence[Signature], fname: str) -> bytes:
    """The ALIGN-byte signature page holding `signatures`."""
    doc = {"signatures": [{"key_id": s.key_id, "signer": s.signer, "ed25519": s.ed25519.hex()}
                          for s in signatures]}
    body = canonical_json(doc)
    page = _PAGE_PREFIX.pack(SIGNATURE_MAGIC, len(body), hashlib.sha256(body).digest()) + body
    if len(page) > ALIGN:
        raise ArtifactError(f"{fname}: {len(signatures)} signatures do not fit the {ALIGN}-byte "
                            "signature page")
    return page.ljust(ALIGN, b"\0")


def decode_page(page: bytes, unsigned_size: int, fname: str) -> tuple[Signature, ...]:
    """The signatures on a page, checked for shape, never for validity. `unsigned_size` (where
    the manifest ends) is named in errors as the size that drops the page."""
    drop = f"`truncate -s {unsigned_size}` drops the page, then sign again"
    magic, length, digest = _PAGE_PREFIX.unpack_from(page)
    if magic != SIGNATURE_MAGIC:
        raise ArtifactError(f"{fname}: the page after the manifest is not a signature page "
                            f"(bad magic {magic!r})")
    body = page[_PAGE_PREFIX.size : _PAGE_PREFIX.size + length]
    if (_PAGE_PREFIX.size + length > len(page) or hashlib.sha256(body).digest() != digest
            or any(page[_PAGE_PREFIX.size + length :])):
        raise ArtifactError(f"{fname}: signature page is corrupt (checksum mismatch); {drop}")
    try:
        doc = json.loads(body)
        if canonical_json(doc) != body or set(_typed(doc, dict)) != {"signatures"}:
            raise ValueError("not the canonical {\"signatures\": [...]}")
        sigs = tuple(_signature(d) for d in _typed(doc["signatures"], list))
        if not sigs or len({s.key_id for s in sigs}) != len(sigs):
            raise ValueError("no signatures, or two by one key")
    except (ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{fname}: signature page is malformed ({e}); {drop}") from e
    return sigs


def require_trusted(signatures: Sequence[Signature], signable: Signable,
                    trusted: Sequence[TrustedKey], fname: str) -> tuple[Signature, ...]:
    """The signatures by `trusted` keys, if there is one and all of them are valid; raises
    otherwise. Signatures by other keys are not checked (their public keys are unknown)."""
    keys = {k.key_id: k for k in trusted}
    if not keys:
        raise ArtifactError(f"{fname}: no trusted keys given to check the signature with")
    if not signatures:
        raise ArtifactError(f"{fname}: not signed, and a signature by a trusted key is required")
    ours = [s for s in signatures if s.key_id in keys]
    if not ours:
        raise ArtifactError(
            f"{fname}: signed only by {', '.join(s.who() for s in signatures)}, not by a trusted "
            f"key ({', '.join(f'{k.key_id} from {k.source}' for k in keys.values())})"
        )
    for s in ours:
        if not signable.is_valid(s, keys[s.key_id]):
            raise ArtifactError(f"{fname}: the signature by {s.who()} does not match this "
                                "artifact (tampered with, or copied from another file)")
    return tuple(ours)


def status(sig: Signature, signable: Signable, trusted: Sequence[TrustedKey]) -> str:
    """"valid", "INVALID", or "not checked" when no trusted key has the signature's id."""
    key = next((k for k in trusted if k.key_id == sig.key_id), None)
    if key is None:
        return "not checked"
    return "valid" if signable.is_valid(sig, key) else "INVALID"


def sign_artifact(path: str | os.PathLike[str], key: Ed25519PrivateKey,
                  signer: str = "") -> tuple[Signature, ...]:
    """Adds a signature by `key` to the artifact at `path` (replacing an earlier one by the same
    key) and returns all its signatures. The file must open cleanly; its sections are not
    re-hashed (run `verify` first if its history is unknown)."""
    # container imports this module for the trust check on open
    from rvcompile.artifacts.container import Artifact

    path = Path(path)
    fname = path.name
    try:
        signer = check_signer(signer)
    except ValueError as e:
        raise ArtifactError(f"{fname}: {e}") from None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ArtifactError(f"{fname}: cannot open for signing: {e.strerror or e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArtifactError(f"{fname}: another process is signing it") from None
        with Artifact.open(path) as art:
            signable, old = art.signable, art.signatures
        kid = key_id(key.public_key())
        new = Signature(kid, signer, key.sign(signable.message(kid, signer)))
        signatures = (*(s for s in old if s.key_id != kid), new)
        page = encode_page(signatures, fname)
        try:
            if os.pwrite(fd, page, signable.page_offset) != len(page):
                raise OSError("short write")
            os.fsync(fd)
        except OSError as e:
            raise ArtifactError(f"{fname}: cannot write the signature page: {e}") from e
    finally:
        os.close(fd)  # releases the lock
    return signatures


def _signature(d: Any) -> Signature:
    d = _typed(d, dict)
    if set(d) != {"key_id", "signer", "ed25519"}:
        raise ValueError(f"signature fields {sorted(d)}")
    kid, sig = _typed(d["key_id"], str), _typed(d["ed25519"], str)
    raw = bytes.fromhex(sig)
    if len(bytes.fromhex(kid)) != 32 or len(raw) != _SIG_SIZE or kid != kid.lower() or \
            sig != sig.lower():
        raise ValueError("key_id must be 64 and ed25519 128 lowercase hex digits")
    return Signature(kid, check_signer(_typed(d["signer"], str)), raw)


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _read_key_file(name: str) -> bytes:
    try:
        with open(name, "rb") as f:
            data = f.read(1 << 16)  # a PEM Ed25519 key is a few hundred bytes
    except OSError as e:
        raise KeyFileError(f"{name}: cannot read key file: {e.strerror or e}") from e
    if len(data) == 1 << 16:
        raise KeyFileError(f"{name}: not a PEM key (over 64 KiB)")
    return data


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Creates `path` with `data` atomically: a temp file linked into place, so that `path`
    appears complete or not at all and an existing file is never replaced."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have removed bits; 0600 must not gain any
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)  # fails if `path` appeared meanwhile
    except OSError as e:
        raise KeyFileError(f"{path}: cannot write key file: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)

