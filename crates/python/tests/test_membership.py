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


@pytest.mark.parametrize("token", ["", "   "])
def test_an_empty_token_in_the_environment_fails_closed(monkeypatch, token):
    # An exported but empty MULTIRAIL_TOKEN once turned membership off without a word.
    monkeypatch.setenv("MULTIRAIL_TOKEN", token)
    with pytest.raises(multirail.ConfigError, match="MULTIRAIL_TOKEN"):
        multirail.Engine(name="127.0.0.1", transport="tcp")


@pytest.mark.parametrize("token", ["", " " * 20])
def test_an_empty_token_in_the_configuration_fails_closed(monkeypatch, token):
    monkeypatch.delenv("MULTIRAIL_TOKEN", raising=False)
    with pytest.raises(multirail.ConfigError, match="auth.token"):
        multirail.Engine({"auth": {"token": token}}, name="127.0.0.1", transport="tcp")


def test_the_effective_configuration_names_the_token_source_not_the_token(monkeypatch):
    monkeypatch.setenv("MULTIRAIL_TOKEN", TOKEN)
    with multirail.Engine(name="127.0.0.1", transport="tcp") as engine:
        assert TOKEN not in str(engine.config)
        assert "from MULTIRAIL_TOKEN" in str(engine.config)
