"""fxglm5.settings: the decode joins' switch (``FXGLM5_DECODE_JOINS``) parses names, 'all' and 'none', refuses an
unknown name by naming it, and by default runs only the MoE router's join (the others measured slower on an H100:
each is opt-in until a GPU run shows it faster)."""

import pytest

from fxglm5 import settings


def test_decode_joins_default_runs_the_moe_router_join_only(monkeypatch):
    monkeypatch.delenv("FXGLM5_DECODE_JOINS", raising=False)
    assert settings.decode_joins() == {"moe_router"}
    assert [name for name in settings.DECODE_JOINS if settings.joins(name)] == ["moe_router"]


@pytest.mark.parametrize("raw, want", [
    ("all", set(settings.DECODE_JOINS)),
    ("none", set()),
    ("", set()),
    ("q_b", {"q_b"}),
    (" indexer , mla_project ", {"indexer", "mla_project"}),
])
def test_decode_joins_parse(monkeypatch, raw, want):
    monkeypatch.setenv("FXGLM5_DECODE_JOINS", raw)
    assert settings.decode_joins() == want
    assert {name for name in settings.DECODE_JOINS if settings.joins(name)} == want


def test_decode_joins_unknown_name_is_named(monkeypatch):
    monkeypatch.setenv("FXGLM5_DECODE_JOINS", "q_b,qb_typo")
    with pytest.raises(ValueError, match="qb_typo"):
        settings.decode_joins()
    monkeypatch.delenv("FXGLM5_DECODE_JOINS")
    with pytest.raises(KeyError, match="nope"):
        settings.joins("nope")
