"""Offline corpus: cleaning, determinism, disjoint splits."""

from __future__ import annotations

import json

import pytest

from qatlib.offline import cleaning, corpus

DOC = """Return the frobnicated value of ``x``.

This function computes the :func:`~pkg.mod.frob` of the argument, see
:class:`Frob <pkg.Frob>` for details. It is **very** useful when the
input is *large*.

>>> frob(3)
9
>>> frob(4)
16

Example::

    y = frob(x)
    print(y)

```python
z = frob(2)
```

.. code-block:: python

    a = [frob(i) for i in range(10)]

.. note::
   The result is cached between calls of the same process and argument.

x = frob(1); y = {k: v for k, v in d.items()}; z = [a[i] for i in range(3)]
"""


def test_clean_text_drops_code_and_markup():
    paras = cleaning.clean_text(DOC)
    text = "\n\n".join(paras)
    assert "frob(3)" not in text and ">>>" not in text
    assert "print(y)" not in text and "z = frob" not in text and "range(10)" not in text
    assert "``" not in text and ":func:" not in text and "**" not in text
    assert "see Frob for details" in text
    assert "pkg.mod.frob" in text
    assert "The result is cached between calls" in text
    assert "d.items()" not in text


def test_split_is_deterministic_and_salted():
    a = corpus.split_of("some text", calib_fraction=0.1, test_fraction=0.2)
    assert a == corpus.split_of("some text", calib_fraction=0.1, test_fraction=0.2)
    texts = [f"document number {i}" for i in range(400)]
    names = [corpus.split_of(t, calib_fraction=0.1, test_fraction=0.2) for t in texts]
    assert set(names) == {"train", "calib", "test"}
    assert 40 <= names.count("test") <= 120
    salted = [corpus.split_of(t, calib_fraction=0.1, test_fraction=0.2, salt="x") for t in texts]
    assert salted != names


def test_check_disjoint_catches_shared_paragraph():
    d1 = corpus.Document("a", "A shared paragraph of some length here.\n\nOnly in a.")
    d2 = corpus.Document("b", "A shared paragraph of some length here!\n\nOnly in b.")
    with pytest.raises(AssertionError):
        corpus.check_disjoint({"train": [d1], "test": [d2]})


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory):
    kw = dict(
        packages=("json", "email", "logging", "unittest"),
        include_stdlib=False,
        include_pydoc_topics=True,
        test_fraction=0.25,
        calib_fraction=0.1,
        workers=1,
        progress=False,
    )
    a = tmp_path_factory.mktemp("corpus_a")
    b = tmp_path_factory.mktemp("corpus_b")
    return a, corpus.build_corpus(a, **kw), b, corpus.build_corpus(b, **kw)


def test_build_corpus_is_deterministic(two_builds):
    a, ma, b, mb = two_builds
    assert ma["content_hash"] == mb["content_hash"]
    assert ma == mb
    for s in corpus.SPLITS:
        assert (a / f"{s}.txt").read_bytes() == (b / f"{s}.txt").read_bytes()
    assert json.loads((a / "manifest.json").read_text()) == ma
    assert (a / "train_sft.jsonl").read_bytes() == (b / "train_sft.jsonl").read_bytes()


def test_build_corpus_splits_are_disjoint_and_clean(two_builds):
    a, m, _, _ = two_builds
    texts = {s: corpus.read_split(a, s) for s in corpus.SPLITS}
    for s in corpus.SPLITS:
        assert m["splits"][s]["documents"] > 0, s
    paras = {s: {cleaning.dedupe_key(p) for p in t.split("\n\n") if p.strip()} for s, t in texts.items()}
    assert not paras["train"] & paras["test"]
    assert not paras["train"] & paras["calib"]
    assert not paras["calib"] & paras["test"]
    srcs = {s: set(m["splits"][s]["sources"]) for s in corpus.SPLITS}
    assert not srcs["train"] & srcs["test"]
    assert ">>>" not in texts["train"]
    assert m["sources"]["pydoc_topics"]["documents"] > 0
    rec = json.loads((a / "train_sft.jsonl").read_text().splitlines()[0])
    assert [x["role"] for x in rec["messages"]] == ["user", "assistant"]
