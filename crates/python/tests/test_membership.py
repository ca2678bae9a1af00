"""Only engines holding the same membership token get in."""

import pytest

import multirail

TOKEN = "python-side-membership-token"


def test_members_move_bytes_and_outsiders_get_not_a_member_error():
    conf = {"auth": {"token": TOKEN}}
    with multirail.Engine(conf, name="127.0.0.1", transport="tcp") as target, multirail.Engine(
        conf, name="127.0.0.1", transport="tcp"
    ) as member, multirail.Engine(name="127.0.0.1", transport="tcp") as outsider:
        dst = target.allocate(1 << 20)
        src = member.allocate(1 << 20)
        memoryview(src)[:] = b"\x5a" * (1 << 20)
        seg = member.open_segment(target.name)
        member.transfer(multirail.Request(multirail.WRITE, src, seg, dst.addr, 1 << 20), timeout=10)
        assert bytes(memoryview(dst)) == bytes(memoryview(src))
        with pytest.raises(multirail.NotAMemberError, match="membership token"):
            outsider.open_segment(target.name)
        assert TOKEN not in str(target.config)
