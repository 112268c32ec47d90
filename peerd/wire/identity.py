"""Node identities (Ed25519), swarm secrets, and the binding of sealing tokens to identities.

A token is derived from its owner's public key and a nonce (PROTOCOL.md section 7.2), so no other key can bind
it: a member cannot squat another member's token by binding it first.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import os
import random
import stat
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import WireError
from .seal import SECRET_SIZE

TOKEN_BINDING_DOMAIN = b"peerd-v1 token binding"
TOKEN_DOMAIN = b"peerd-v1 token"
TOKEN_NONCE_SIZE = 8
BINDING_SIZE = TOKEN_NONCE_SIZE + 64  # a ``from``'s ``sig``: the token's nonce, then the Ed25519 signature
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64


class KeyFileError(Exception):
    """A key file that is missing, unreadable or malformed; the message says what to do."""


def node_id_of(public_key: bytes) -> bytes:
    return hashlib.sha256(public_key).digest()


def token_of(public_key: bytes, nonce: bytes) -> int:
    """The sealing token that ``public_key`` owns under ``nonce``: the first 8 bytes of
    SHA-256("peerd-v1 token" || pk || nonce), big-endian (0 is never used: its owner draws another nonce)."""
    return int.from_bytes(hashlib.sha256(TOKEN_DOMAIN + public_key + nonce).digest()[:8], "big")


@dataclass(frozen=True)
class TokenBinding:
    """One sealer's token and what proves it is its identity's: the nonce it was derived from and the signature."""

    public_key: bytes
    token: int
    nonce: bytes
    sig: bytes

    @property
    def proof(self) -> bytes:
        """What a ``from`` carries as ``sig`` (BINDING_SIZE bytes): the nonce, then the signature."""
        return self.nonce + self.sig

    def sender(self, addr: object = None) -> dict[str, object]:
        """The ``from`` field of the control messages this token seals (``addr``: as packed for the wire)."""
        return {"pk": self.public_key, "sig": self.proof, "addr": addr}


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey
    public_key: bytes = field(init=False)
    node_id: bytes = field(init=False)

    def __post_init__(self) -> None:
        pk = self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        object.__setattr__(self, "public_key", pk)
        object.__setattr__(self, "node_id", node_id_of(pk))

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def sign_token(self, token: int) -> bytes:
        return self.sign(TOKEN_BINDING_DOMAIN + token.to_bytes(8, "big"))

    def bind_token(self, rng: random.Random | None = None, *, nonce: bytes | None = None) -> TokenBinding:
        """A new sealing token of this identity, with its binding: from ``nonce`` if given, else from a nonce
        drawn from ``rng`` (default: os entropy; a seeded one only in tests and simulations)."""
        while True:
            n = nonce
            if n is None:
                n = rng.getrandbits(64).to_bytes(8, "big") if rng is not None else os.urandom(TOKEN_NONCE_SIZE)
            if len(n) != TOKEN_NONCE_SIZE:
                raise ValueError(f"a token nonce is {TOKEN_NONCE_SIZE} bytes, got {len(n)}")
            token = token_of(self.public_key, n)
            if token:
                return TokenBinding(self.public_key, token, n, self.sign_token(token))
            if nonce is not None:
                raise ValueError("this nonce derives token 0, which is never used: draw another")

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_token_binding(public_key: bytes, token: int, proof: bytes) -> None:
    """Raise WireError("identity") unless ``proof`` (nonce || signature, a ``from``'s ``sig``) shows that ``token``
    is derived from ``public_key`` under the nonce and is signed by its key."""
    nonce, signature = proof[:TOKEN_NONCE_SIZE], proof[TOKEN_NONCE_SIZE:]
    if len(proof) != BINDING_SIZE or token_of(public_key, nonce) != token:
        raise WireError("identity", "the token is not derived from the sender's public key")
    if not verify(public_key, signature, TOKEN_BINDING_DOMAIN + token.to_bytes(8, "big")):
        raise WireError("identity", "token binding signature does not verify")


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def write_identity(path: str) -> Identity:
    ident = Identity.generate()
    _write_private(path, ident.to_pem())
    return ident


# POSIX ACL entries as Linux stores them in the ``system.posix_acl_access`` attribute (acl_ea.h)
_ACL_HEADER, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK = 0x02, 0x04, 0x08, 0x10


def acl_open_to_others(acl: bytes, uid: int) -> bool:
    """Whether a POSIX access ACL lets anyone but the file's owner and ``uid`` at the file: its owning group,
    a named group or another named user, each through the mask. (systemd hands a service its credentials as
    root-owned 0400 files with one ACL entry for the service's user, which ``ls`` shows as 0440.)"""
    if len(acl) < _ACL_HEADER.size or (len(acl) - _ACL_HEADER.size) % _ACL_ENTRY.size:
        return True  # not an ACL this check understands: as open as it may be
    entries = [_ACL_ENTRY.unpack_from(acl, off) for off in range(_ACL_HEADER.size, len(acl), _ACL_ENTRY.size)]
    mask = next((perm for tag, perm, _ in entries if tag == _ACL_MASK), 0o7)
    return any(perm & mask for tag, perm, who in entries
               if tag in (_ACL_GROUP_OBJ, _ACL_GROUP) or (tag == _ACL_USER and who != uid))


def _open_to_others(fd: int, mode: int) -> bool:
    """Whether group or others may use the open file ``fd`` (of permission bits ``mode``); with an access ACL,
    the group bits are its mask, and the entries decide."""
    if mode & 0o007:
        return True
    if not mode & 0o070:
        return False
    try:
        acl = os.getxattr(fd, "system.posix_acl_access")
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return True  # no ACL: the group bits are the owning group's
        raise
    return acl_open_to_others(acl, os.geteuid())


def _read_private(path: str, what: str, hint: str) -> bytes:
    """A key file's bytes, refused when group or others may read or write it: a secret that others can read
    is no longer this node's alone (keygen writes 0600, so the normal flow passes)."""
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if _open_to_others(f.fileno(), mode):
                raise KeyFileError(f"{what} {path} is open to group or others (mode {mode:04o}): "
                                   f"run 'chmod 600 {path}' and start again")
            return f.read()
    except OSError as e:
        raise KeyFileError(f"cannot read {what} {path}: {e.strerror}; {hint}") from None


def load_identity(path: str) -> Identity:
    data = _read_private(path, "identity file", f"create one with 'peerd keygen --identity {path}'")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path} is not a peerd identity (PEM Ed25519 key from 'peerd keygen')") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a key that is not Ed25519; create one with 'peerd keygen --identity PATH'")
    return Identity(key)


def write_swarm_key(path: str) -> bytes:
    secret = os.urandom(SECRET_SIZE)
    _write_private(path, base64.b64encode(secret) + b"\n")
    return secret


def load_swarm_key(path: str) -> bytes:
    text = _read_private(path, "swarm key file", "get it from the swarm's operator, or start a new swarm with "
                         f"'peerd keygen --swarm-key-file {path}'").strip()
    try:
        secret = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        secret = b""
    if len(secret) != SECRET_SIZE:
        raise KeyFileError(
            f"{path} is not a swarm key (expected base64 of {SECRET_SIZE} bytes, "
            f"as written by 'peerd keygen --swarm-key-file')"
        )
    return secret
