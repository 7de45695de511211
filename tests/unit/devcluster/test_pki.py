import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vkubelet.devcluster import _pki


def test_leaf_certificate_is_signed_by_its_ca_and_carries_identity_and_sans() -> None:
    ca = _pki.new_ca("test-ca")
    leaf = _pki.issue(
        ca,
        "system:node:n1",
        organizations=("system:nodes",),
        server=True,
        client=True,
        dns_names=("n1.local",),
        ip_addresses=("127.0.0.1",),
    )
    leaf.cert.verify_directly_issued_by(ca.cert)
    subject = leaf.cert.subject
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:n1"
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    sans = leaf.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["n1.local"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    usages = leaf.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_private_keys_are_written_readable_by_owner_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cert_path, key_path = _pki.new_ca("ca").write(tmp_path, "ca")
    assert key_path.stat().st_mode & 0o777 == 0o600
    loaded = _pki.load(cert_path, key_path)
    assert isinstance(loaded.key, ec.EllipticCurvePrivateKey)


def test_csr_names_the_requested_identity() -> None:
    key = _pki.new_key()
    csr = x509.load_pem_x509_csr(_pki.csr_pem(key, "system:node:a", ("system:nodes",)))
    assert csr.is_signature_valid
    assert csr.subject.rfc4514_string() == "CN=system:node:a,O=system:nodes"


def test_a_leaf_must_be_for_server_or_client() -> None:
    import pytest

    with pytest.raises(ValueError, match="server, a client"):
        _pki.issue(_pki.new_ca("ca"), "nobody")
