"""Every module, class and function the package's docstrings name, and every repository path the docs name,
exists (:mod:`tests.doc_references` reads them): a rename that leaves a reference behind fails here."""

from __future__ import annotations

import pytest

from tests.doc_references import Resolver, stale_paths, stale_roles


@pytest.fixture(scope="module")
def resolver() -> Resolver:
    return Resolver()


def test_docstring_references_exist(resolver: Resolver) -> None:
    stale = list(stale_roles(resolver))
    assert not stale, "references to names that do not exist:\n" + "\n".join(stale)


def test_doc_paths_exist(resolver: Resolver) -> None:
    stale = list(stale_paths(resolver))
    assert not stale, "paths in the docs that do not exist:\n" + "\n".join(stale)


def test_resolver_finds_what_is_there_and_not_what_is_not(resolver: Resolver) -> None:
    """The resolver itself: relative, absolute, through an import, a class member, a lazy root export."""
    module = "megatron_pp_ext.runtime.executor"
    assert resolver.exists(resolver.resolve_in(module, ".overlap.find_overlap_hook") or "")
    assert resolver.exists("megatron_pp_ext.schedules.lowering.Compute")
    assert resolver.exists("megatron_pp_ext.install")  # the package root's lazy name
    assert resolver.exists("megatron_pp_ext.schedules.engine.Engine.is_forward")
    assert not resolver.exists(resolver.resolve_in(module, ".report") or "")
    assert not resolver.exists("megatron_pp_ext.schedules.lowering.Computation")
    assert not resolver.exists("megatron_pp_ext.schedules.engine.Engine.is_backwards")
    assert resolver.exists(resolver.resolve_in(module, "torch.Tensor") or "")  # another project's name: not checked
