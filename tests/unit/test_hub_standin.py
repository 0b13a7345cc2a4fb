"""The stand-in itself: loopback only, bounded waits, stops by itself, stores only verified uploads."""

import hashlib
import time

import httpx
import pytest

from hub_standin import HubStandin

# Loopback only: never through a proxy from the environment.
http = httpx.Client(trust_env=False, timeout=10)


def test_binds_loopback_only_and_stops_by_itself(tmp_path):
    h = HubStandin(tmp_path, lifetime=0.5).start()
    assert h._server.server_address[0] == "127.0.0.1"
    url = h.endpoint
    assert http.get(f"{url}/api/models/a/b").status_code == 401  # anonymous, unknown repo
    time.sleep(1.5)
    with pytest.raises(httpx.TransportError):
        http.get(f"{url}/api/models/a/b")


def test_unknown_route_is_a_404_that_says_so(tmp_path):
    with HubStandin(tmp_path) as h:
        r = http.post(f"{h.endpoint}/api/something-new")
        assert r.status_code == 404 and "stand-in: no route" in r.headers["X-Error-Message"]


def _ticket(h, oid: str, size: int, token="t") -> str:
    r = http.post(f"{h.endpoint}/alice/m.git/info/lfs/objects/batch", headers={"Authorization": f"Bearer {token}"},
                   json={"operation": "upload", "objects": [{"oid": oid, "size": size}]})
    return r.json()["objects"][0]["actions"]["upload"]["href"]


def test_upload_with_wrong_content_is_not_stored(tmp_path):
    with HubStandin(tmp_path, tokens={"t": "alice"}) as h:
        h.create_repo("alice/m")
        data = b"x" * 1000
        oid = hashlib.sha256(data).hexdigest()
        href = _ticket(h, oid, len(data))
        assert http.put(href, content=b"y" * 1000).status_code == 400
        assert h.lfs_puts == [] and not (tmp_path / ".objects" / oid).exists()
        assert http.put(href, content=data).status_code == 200 and h.lfs_puts == [oid]


def test_held_upload_is_cut_after_hold_timeout(tmp_path):
    with HubStandin(tmp_path, tokens={"t": "alice"}, hold_timeout=0.5) as h:
        h.create_repo("alice/m")
        h.hold_lfs_puts_after(0)
        data = b"z" * 5000
        oid = hashlib.sha256(data).hexdigest()
        t0 = time.time()
        with pytest.raises(httpx.TransportError):
            http.put(_ticket(h, oid, len(data)), content=data)
        assert time.time() - t0 < 5 and h.held.is_set() and h.lfs_puts == []


def test_writes_need_a_token_for_the_namespace(tmp_path):
    with HubStandin(tmp_path, tokens={"t": "alice"}) as h:
        r = http.post(f"{h.endpoint}/api/repos/create", json={"name": "m", "organization": "bob"},
                       headers={"Authorization": "Bearer t"})
        assert r.status_code == 403
        r = http.post(f"{h.endpoint}/api/repos/create", json={"name": "m"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.headers["X-Error-Message"] == "Invalid credentials in Authorization header"
        assert h.repos == {}
