"""Parametrizes the pass template's tests (tests/passes/template.py) over the keys of the data each pass gives."""

from tests.passes.template import PassTemplate


def pytest_generate_tests(metafunc):
    cls = metafunc.cls
    if cls is not None and issubclass(cls, PassTemplate) and metafunc.function.__name__ in cls.PARAMS:
        argname, attr = cls.PARAMS[metafunc.function.__name__]
        metafunc.parametrize(argname, list(getattr(cls, attr)))
