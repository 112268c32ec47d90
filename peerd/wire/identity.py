"""Node identities (Ed25519), swarm secrets, and the signed binding of tokens to identities."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import WireError
from .seal import SECRET_SIZE

TOKEN_BINDING_DOMAIN = b"peerd-v1 token binding"
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64


class KeyFileError(Exception):
    """A key file that is missing, unreadable or malformed; the message says what to do."""


def node_id_of(public_key: bytes) -> bytes:
    return hashlib.sha256(public_key).digest()


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


def verify_token_binding(public_key: bytes, token: int, signature: bytes) -> None:
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


def load_identity(path: str) -> Identity:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise KeyFileError(
            f"cannot read identity file {path}: {e.strerror}; create one with 'peerd keygen --identity {path}'"
        ) from None
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
    try:
        with open(path, "rb") as f:
            text = f.read().strip()
    except OSError as e:
        raise KeyFileError(
            f"cannot read swarm key file {path}: {e.strerror}; get it from the swarm's operator, "
            f"or start a new swarm with 'peerd keygen --swarm-key-file {path}'"
        ) from None
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
