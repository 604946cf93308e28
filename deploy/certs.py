"""TLS certificates for the SuperLink and authentication key pairs for SuperNodes.

Usage::

    python -m deploy.certs ca        --out certs                       # certs/ca.crt, ca.key
    python -m deploy.certs superlink --out certs --hosts superlink,10.0.0.5,127.0.0.1
    python -m deploy.certs supernode --out certs/supernodes --names pi-1,jetson-1

``superlink`` signs ``server.pem`` / ``server.key`` with the CA (``ca`` first; it is made
when missing) for every DNS name / IP address in ``--hosts``: the address SuperNodes and
the ``flwr`` CLI dial must be one of them.  ``supernode`` writes one ECDSA P-384 key pair
per name in OpenSSH format (``NAME`` private, ``NAME.pub`` public) -- what
``flower-supernode --auth-supernode-private-key`` reads and ``flwr supernode register``
takes.  Register each public key once, from the workstation that submits runs::

    flwr supernode register certs/supernodes/pi-1.pub <connection>

(keys and node ids are fixed at registration).  Private keys never leave their device:
copy only ``ca.crt`` and the device's own key there.  Built on ``cryptography`` (already a
Flower dependency), so no ``openssl`` binary is needed on either side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Validity of generated certificates (days).
VALID_DAYS = 825


@dataclass(frozen=True)
class ServerFiles:
    """What the SuperLink is started with (``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile``)."""

    ca_cert: Path
    cert: Path
    key: Path


def _keep_out_of_git(folder: Path) -> None:
    """A ``.gitignore`` of ``*`` in every folder that holds keys, so none is ever committed."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / ".gitignore"
    if not marker.exists():
        marker.write_text("# private keys and certificates: never commit\n*\n")


def _write_private(path: Path, data: bytes) -> None:
    _keep_out_of_git(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew


def make_ca(out: Path, *, name: str = "hetfl federation CA") -> tuple[Path, Path]:
    """Create a self-signed CA (``ca.crt``, ``ca.key``) in ``out``; keep ``ca.key`` offline."""
    key = ec.generate_private_key(ec.SECP384R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    crt, pkey = out / "ca.crt", out / "ca.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(pkey, _pem_key(key))
    return crt, pkey


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_server_cert(out: Path, hosts: Sequence[str]) -> ServerFiles:
    """Sign ``server.pem`` / ``server.key`` for ``hosts`` with the CA in ``out`` (made if missing)."""
    if not hosts:
        raise ValueError("give at least one host name or IP address the SuperLink is reached at")
    crt, pkey = out / "ca.crt", out / "ca.key"
    if not (crt.exists() and pkey.exists()):
        make_ca(out)
    ca_cert = x509.load_pem_x509_certificate(crt.read_bytes())
    ca_key = serialization.load_pem_private_key(pkey.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pkey}: expected an EC private key")
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = ServerFiles(crt, out / "server.pem", out / "server.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.key, _pem_key(key))
    return files


def make_supernode_key(out: Path, name: str) -> tuple[Path, Path]:
    """One SuperNode's ECDSA P-384 key pair in OpenSSH format: ``out/NAME``, ``out/NAME.pub``."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = out / name
    public = out / f"{name}.pub"
    _write_private(
        private,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    public.write_bytes(pub + f" {name}\n".encode())
    return private, public


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("ca", help="a new CA (ca.crt, ca.key)")
    p.add_argument("--out", type=Path, default=Path("certs"))
    p = sub.add_parser("superlink", help="server.pem/server.key for the SuperLink, signed by the CA")
    p.add_argument("--out", type=Path, default=Path("certs"))
    p.add_argument("--hosts", required=True, help="comma-separated DNS names / IPs the SuperLink is reached at")
    p = sub.add_parser("supernode", help="OpenSSH ECDSA key pairs for SuperNode authentication")
    p.add_argument("--out", type=Path, default=Path("certs/supernodes"))
    p.add_argument("--names", required=True, help="comma-separated device names, e.g. pi-1,jetson-1")
    args = parser.parse_args(argv)
    if args.what == "ca":
        for f in make_ca(args.out):
            print(f)
    elif args.what == "superlink":
        files = make_server_cert(args.out, [h.strip() for h in args.hosts.split(",") if h.strip()])
        print(f"{files.ca_cert}\n{files.cert}\n{files.key}")
    else:
        for name in args.names.split(","):
            for f in make_supernode_key(args.out, name.strip()):
                print(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
