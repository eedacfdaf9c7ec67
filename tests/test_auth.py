"""Authentication and tenant isolation: API keys (hashed, reloadable) and client certificates."""

import datetime
import ipaddress
import json
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tokenline.client import Client
from tokenline.client.errors import AlreadyExists, Unauthenticated, Unavailable
from tokenline.server.auth import hash_key
from tests.support import ServerProcess, wait_until

KEY_A, KEY_B, KEY_C = "key-for-a", "key-for-b", "key-for-c"


def write_keys(path, tenants):
    path.write_text(json.dumps({"tenants": {t: {"keys": [hash_key(k)]} for t, k in tenants.items()}}))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys.json"
    write_keys(path, {"a": KEY_A, "b": KEY_B})
    return path


@pytest.fixture(scope="module")
def server(keys_file):
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(keys_file), "--idempotency-db", "off").start()
    yield s
    s.stop()


def test_the_keys_file_stores_hashes_not_keys(keys_file):
    text = keys_file.read_text()
    assert KEY_A not in text and hash_key(KEY_A) in text


@pytest.mark.parametrize("api_key", [None, "wrong-key", ""])
def test_a_missing_or_wrong_key_is_unauthenticated(server, api_key):
    with Client(server.address, api_key=api_key) as client, pytest.raises(Unauthenticated):
        client.complete("hello", max_tokens=2)


def test_a_malformed_authorization_header_is_unauthenticated(server):
    with grpc.insecure_channel(server.address) as channel:
        from tokenline.v1 import tokenline_pb2 as pb
        from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.TokenlineStub(channel).Complete(pb.GenerateRequest(text="hi"), metadata=(("authorization", "Basic xyz"),), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in info.value.details()


def test_health_needs_no_key(server):
    assert server.health() == 1


@pytest.mark.parametrize("method", ["list_models", "cancel"])
def test_every_method_needs_a_key(server, method):
    with Client(server.address) as client, pytest.raises(Unauthenticated):
        getattr(client, method)(*(["x"] if method == "cancel" else []))


def test_tenants_cannot_see_or_cancel_each_others_requests(server):
    with Client(server.address, api_key=KEY_A) as a, Client(server.address, api_key=KEY_B) as b:
        stream = a.generate("long", max_tokens=1500, ignore_eos=True, request_id="same-id")
        first = next(iter(stream))
        assert first.request_id == "same-id"
        # The same id is free for another tenant, and taken for the same tenant.
        assert len(b.complete("short", max_tokens=3, request_id="same-id").token_ids) == 3
        with pytest.raises(AlreadyExists):
            a.complete("again", max_tokens=3, request_id="same-id")
        # B cannot cancel A's request: to B it does not exist.
        assert b.cancel("same-id") is False
        tokens = len(first.token_ids) + sum(len(d.token_ids) for d in stream)
    assert tokens == 1500


def test_a_reloaded_keys_file_takes_effect_without_a_restart(server, keys_file):
    with Client(server.address, api_key=KEY_C) as c, pytest.raises(Unauthenticated):
        c.complete("hi", max_tokens=2)
    time.sleep(1.1)  # file mtimes have a resolution; make the change visible
    write_keys(keys_file, {"a": KEY_A, "b": KEY_B, "c": KEY_C})

    def c_works():
        try:
            with Client(server.address, api_key=KEY_C) as c:
                return len(c.complete("hi", max_tokens=2, ignore_eos=True).token_ids) == 2
        except Unauthenticated:
            return False

    assert wait_until(c_works, timeout=15)


# ------------------------------------------------------------------ mutual TLS

def _cert(subject_cn, issuer_key, issuer_name, key, *, ca=False, san=None):
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj):
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("tokenline test CA", ca_key, None, ca_key, ca=True)
    out = {"dir": d, "ca": _pem(ca)}
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _cert("localhost", ca_key, ca.subject, server_key,
                        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for name, data in (("ca.pem", _pem(ca)), ("server.pem", _pem(server_cert)), ("server.key", _pem(server_key))):
        (d / name).write_bytes(data)
    for tenant in ("team-x", "team-y"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[tenant] = (_pem(key), _pem(_cert(tenant, ca_key, ca.subject, key)))
    return out


def test_mutual_tls_maps_client_certificates_to_tenants(pki):
    d = pki["dir"]
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--tls-cert", str(d / "server.pem"),
                           "--tls-key", str(d / "server.key"), "--tls-client-ca", str(d / "ca.pem"),
                           "--idempotency-db", "off")
    server.start_listening()
    try:
        def client(tenant):
            key, cert = pki[tenant]
            return Client(server.address, root_certificates=pki["ca"], private_key=key, certificate_chain=cert)

        assert wait_until(lambda: _serves(client("team-x")), timeout=120)
        with client("team-x") as x, client("team-y") as y:
            stream = x.generate("long", max_tokens=800, ignore_eos=True, request_id="shared")
            next(iter(stream))
            # Different certificates are different tenants: the id is free for y, and x's request is invisible to y.
            assert len(y.complete("short", max_tokens=3, request_id="shared").token_ids) == 3
            assert y.cancel("shared") is False
            stream.cancel()
        # No client certificate: the TLS handshake itself is refused.
        with Client(server.address, root_certificates=pki["ca"]) as anonymous, pytest.raises((Unavailable, Unauthenticated)):
            anonymous.complete("hi", max_tokens=2, timeout=10)
    finally:
        server.stop()


def _serves(client) -> bool:
    try:
        with client:
            return all(m.loaded for m in client.list_models(timeout=5))
    except Exception:
        return False


# ------------------------------------------------------------ keys file changes

@pytest.fixture(scope="module")
def quota_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("quota") / "keys.json"
    write_keys(path, {"a": KEY_A})
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(path), "--idempotency-db", "off").start()
    s.keys_file = path
    yield s
    s.stop()


def _rewrite(path, doc):
    time.sleep(1.1)  # file mtimes have a resolution; make the change visible
    path.write_text(json.dumps(doc))


def test_quotas_in_a_changed_keys_file_apply_without_a_signal(quota_server):
    from tokenline.client.errors import Overloaded

    _rewrite(quota_server.keys_file, {"tenants": {"a": {"keys": [hash_key(KEY_A)], "max_concurrent": 1}}})
    with Client(quota_server.address, api_key=KEY_A) as a:
        def second_is_refused():
            stream = a.generate("long", max_tokens=1500, ignore_eos=True)
            next(iter(stream))
            try:
                a.complete("short", max_tokens=2)
                return False
            except Overloaded as err:
                return "limit is 1" in err.details
            finally:
                stream.cancel()

        assert wait_until(second_is_refused, timeout=15)


@pytest.mark.parametrize("doc", [
    {"tenants": {"a": {"keys": [hash_key(KEY_A)], "max_concurrent": "ten"}}},
    {"tenants": {"a": {"keys": [hash_key(KEY_A)], "weight": None}}},
    {"tenants": {"a": {"keys": [hash_key(KEY_A)], "max_concurrent": True}}},
    {"tenants": {"a": {"keys": hash_key(KEY_A)}}},
    {"tenants": {"a": [hash_key(KEY_A)]}},
    {"tenants": [hash_key(KEY_A)]},
    ["not", "an", "object"],
])
def test_a_keys_file_with_wrong_types_is_reported_and_the_previous_one_kept(quota_server, doc):
    def reports():
        return quota_server.output().count("keys file not reloaded, keeping the previous one")

    before = reports()
    _rewrite(quota_server.keys_file, doc)
    assert wait_until(lambda: reports() > before, timeout=10)
    # The previous file stays in force: requests are served, never answered UNKNOWN.
    with Client(quota_server.address, api_key=KEY_A) as a:
        assert len(a.complete("hi", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_a_bad_keys_file_at_start_is_a_clear_error(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"a": {"keys": [hash_key(KEY_A)], "max_concurrent": "ten"}}}))
    server = ServerProcess("--engine", "sim", "--model", "tiny", "--api-keys", str(path), "--idempotency-db", "off")
    server.start_listening(timeout=120)
    assert server.wait(60) == 2
    assert "max_concurrent must be a whole number" in server.output()
    assert "Traceback" not in server.output()
