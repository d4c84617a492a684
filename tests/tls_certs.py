"""Throwaway certificates for the TLS tests: a CA, a server certificate for
127.0.0.1/localhost and a client certificate signed by it, and a second CA whose
certificates the first one does not trust.

Made with the ``cryptography`` package when it is installed, else with the
``openssl`` binary. EC P-256 keys: generating them takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import pathlib
import secrets
import subprocess


@dataclasses.dataclass(frozen=True)
class PKI:
    """Paths of PEM files."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str


def make_pki(directory: pathlib.Path, use_openssl: bool = False) -> PKI:
    try:
        if use_openssl:
            raise ImportError
        import cryptography  # noqa: F401
        make = _with_cryptography
    except ImportError:
        make = _with_openssl
    d = pathlib.Path(directory)
    make(d, "ca", None, "Tandem test CA")
    make(d, "server", "ca", "localhost", server=True)
    make(d, "client", "ca", "tandem test client")
    make(d, "other_ca", None, "Untrusted test CA")
    make(d, "other_client", "other_ca", "untrusted client")
    return PKI(**{f.name: str(d / _file_of(f.name)) for f in dataclasses.fields(PKI)})


def _file_of(field: str) -> str:
    if field.endswith("_cert"):
        return field[:-5] + ".pem"
    if field.endswith("_key"):
        return field[:-4] + ".key"
    return field + ".pem"


def _with_cryptography(d: pathlib.Path, name: str, issuer: str | None, cn: str,
                       server: bool = False) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    if issuer is None:
        issuer_name, signing_key = subject, key
    else:
        issuer_cert = x509.load_pem_x509_certificate((d / f"{issuer}.pem").read_bytes())
        issuer_name = issuer_cert.subject
        signing_key = serialization.load_pem_private_key((d / f"{issuer}.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1))
         .not_valid_after(now + datetime.timedelta(days=2)))
    if issuer is None:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    cert = b.sign(signing_key, hashes.SHA256())
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


def _with_openssl(d: pathlib.Path, name: str, issuer: str | None, cn: str,
                  server: bool = False) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    key, pem = f"{name}.key", f"{name}.pem"
    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
              "-subj", f"/CN={cn}"]
    if issuer is None:
        run("req", "-x509", *newkey, "-out", pem, "-days", "2",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign")
        return
    run("req", *newkey, "-out", f"{name}.csr")
    ext = ["basicConstraints=critical,CA:FALSE",
           f"extendedKeyUsage={'serverAuth' if server else 'clientAuth'}"]
    if server:
        ext.append("subjectAltName=DNS:localhost,IP:127.0.0.1")
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem", "-CAkey", f"{issuer}.key",
        "-set_serial", str(secrets.randbits(60) + 1), "-out", pem, "-days", "2",
        "-extfile", f"{name}.ext")
