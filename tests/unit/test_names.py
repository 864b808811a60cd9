"""Object names that URL (form) encoding changes, decoded by the store without a server. Through real
mounts and real listings on moto and SeaweedFS: tests/mount/test_names_mount.py."""

from __future__ import annotations

from fsmount.data.boto3_store import _decode_key


def test_form_encoded_names_decode() -> None:
    assert _decode_key("dir/my+name.txt", True) == "dir/my name.txt"
    assert _decode_key("a%2Bb", True) == "a+b"
    assert _decode_key("a%2520b", True) == "a%20b"
    assert _decode_key("+++", True) == "   "
    assert _decode_key("a+b", False) == "a+b"
