"""A Spec holds plain values (exactly int, float, str, bool, None, tuples of them, a
Hilbert of them) however it is made, and codegen renders nothing else (issue 56, item 3).

A value of a subclass prints itself by its own __str__/__repr__/__format__ in a template,
but by int.__repr__ in the JSON that the cache key hashes: without the copy to plain
types, such a value gives the clean spec's key and a module that runs its payload."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from dilgen.codegen import emit
from dilgen.planner import plan
from dilgen.spec import Hilbert, Spec, SpecError, spec_from_dict
from dilgen.targets import get_target

PAYLOAD = "16 if not __import__('os').system('touch /tmp/pwned') else 16"


class HInt(int):
    """An int that prints as code, claims another value by __int__/__index__, equals
    everything and is never below or above anything."""
    def __str__(self): return PAYLOAD
    __repr__ = __str__
    def __format__(self, spec): return PAYLOAD
    def __int__(self): return 1000 + int.__int__(self)
    __index__ = __int__
    def __float__(self): return 1000.0
    def __eq__(self, other): return True
    __hash__ = int.__hash__
    def __lt__(self, other): return False
    __gt__ = __le__ = __ge__ = __lt__


class HFloat(float):
    def __str__(self): return PAYLOAD
    __repr__ = __str__
    def __format__(self, spec): return PAYLOAD
    def __float__(self): return 1000.0
    def __eq__(self, other): return True
    __hash__ = float.__hash__


class HStr(str):
    def __str__(self): return PAYLOAD
    __repr__ = __str__
    def __format__(self, spec): return PAYLOAD
    def __eq__(self, other): return True
    __hash__ = str.__hash__


class HList(list):
    """A list whose iteration, length and items lie about what it holds."""
    def __iter__(self): return iter([HInt(8)])
    def __len__(self): return 1
    def __getitem__(self, i): return HInt(8)


class Claims:
    """Not a number: an object whose __class__ claims to be one (isinstance believes it)."""
    def __init__(self, cls): self._cls = cls
    __class__ = property(lambda self: self._cls)
    def __str__(self): return PAYLOAD
    __repr__ = __format__ = lambda self, *a: PAYLOAD
    def __bool__(self): return True
    def __eq__(self, other): return True
    __hash__ = object.__hash__
    def __lt__(self, other): return False
    __gt__ = __le__ = __ge__ = __lt__


BASE = dict(name="plain_attn", num_heads=8, num_kv_heads=2, head_dim=64, dtype="float16",
            segment_lengths=[16, 32], dilation_rates=[1, 2])

# field: (clean fields, the same values as hostile subclasses); each beside BASE. Every
# field but causal (bool cannot be subclassed: test_object_claiming_a_plain_class_is_refused)
CASES = {
    "name": ({"name": "plain_attn"}, {"name": HStr("plain_attn")}),
    "num_heads": ({"num_heads": 8}, {"num_heads": HInt(8)}),
    "num_kv_heads": ({"num_kv_heads": 2}, {"num_kv_heads": HInt(2)}),
    "head_dim": ({"head_dim": 64}, {"head_dim": HInt(64)}),
    "head_dim_padded": ({"head_dim": 40}, {"head_dim": HInt(40)}),
    "segment_lengths": ({"segment_lengths": [16, 32]}, {"segment_lengths": [HInt(16), HInt(32)]}),
    "dilation_rates": ({"dilation_rates": [1, 2]}, {"dilation_rates": [HInt(1), HInt(2)]}),
    "dtype": ({"dtype": "float32"}, {"dtype": HStr("float32")}),
    "hilbert_segment": ({"hilbert": {"scope": "segment", "grids": [[4, 4], [4, 8]]}},
                        {"hilbert": {HStr("scope"): HStr("segment"),
                                     "grids": [[HInt(4), HInt(4)], [HInt(4), HInt(8)]]}}),
    "hilbert_sequence": ({"hilbert": {"scope": "sequence", "grid": [8, 16]}},
                         {"hilbert": {"scope": HStr("sequence"), "grid": [HInt(8), HInt(16)]}}),
    "ring_size": ({"ring_size": 2}, {"ring_size": HInt(2)}),
    "softmax_scale": ({"softmax_scale": 0.125}, {"softmax_scale": HFloat(0.125)}),
    "softmax_scale_int": ({"softmax_scale": 1}, {"softmax_scale": HInt(1)}),
    "head_offsets": ({"head_offsets": "block"}, {"head_offsets": HStr("block")}),
    "short_segments": ({"short_segments": "zero_pad"}, {"short_segments": HStr("zero_pad")}),
    "head_base": ({"head_base": 4}, {"head_base": HInt(4)}),
}


def _build(path: str, fields: dict) -> Spec:
    """A Spec of BASE with `fields`, made by one of the ways a Spec is made."""
    if path == "constructor":
        return Spec(**{**BASE, **fields})
    if path == "replace":
        return Spec(**BASE).replace(**fields)
    if path == "dataclasses.replace":
        return dataclasses.replace(Spec(**BASE), **fields)
    if path == "from_dict":
        return spec_from_dict({**BASE, **fields})
    if path == "pickle":
        return pickle.loads(pickle.dumps(Spec(**{**BASE, **fields})))
    raise AssertionError(path)


PATHS = ("constructor", "replace", "dataclasses.replace", "from_dict")


def _assert_plain(value, where: str) -> None:
    """Exactly the plain types, all the way down (tuples, and a Hilbert's fields)."""
    if type(value) is Hilbert:
        for f in dataclasses.fields(Hilbert):
            _assert_plain(getattr(value, f.name), f"{where}.{f.name}")
    elif type(value) is tuple:
        for i, item in enumerate(value):
            _assert_plain(item, f"{where}[{i}]")
    else:
        assert type(value) in (int, float, str, bool, type(None)), (where, type(value))


def _assert_spec_plain(spec: Spec) -> None:
    for f in dataclasses.fields(Spec):
        _assert_plain(getattr(spec, f.name), f.name)


def _source(spec: Spec) -> str:
    return emit(plan(spec, get_target("sm90")))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_subclass_becomes_the_plain_value(case, path):
    clean_fields, hostile_fields = CASES[case]
    clean = Spec(**{**BASE, **clean_fields})
    spec = _build(path, hostile_fields)
    _assert_spec_plain(spec)
    assert spec.to_json() == clean.to_json() and spec == clean
    assert spec.key() == clean.key()
    source = _source(spec)
    assert "__import__" not in source and "__import__" not in spec.source
    assert source == _source(clean)


def test_hilbert_object_of_hostile_values_is_rebuilt_plain():
    hostile = Hilbert(HStr("segment"), grids=((HInt(4), HInt(4)), (HInt(4), HInt(8))))
    spec = Spec(**BASE, hilbert=hostile)
    clean = Spec(**BASE, hilbert={"scope": "segment", "grids": [[4, 4], [4, 8]]})
    _assert_spec_plain(spec)
    assert spec.key() == clean.key() and _source(spec) == _source(clean)


@pytest.mark.parametrize("path", ("constructor", "dataclasses.replace", "from_dict"))
def test_hostile_source_becomes_a_plain_one_line_string(path):
    if path == "from_dict":
        spec = spec_from_dict(BASE, source=HStr("api\nx"))
    else:
        spec = _build(path, {"source": HStr("api\nx")})
    assert type(spec.source) is str and spec.source == "api\\nx"
    with pytest.raises(SpecError, match=r"^<spec>: source = .*: must be a string"):
        Spec(**BASE, source=HInt(3))
    with pytest.raises(SpecError, match=r"^api: num_heads = 0: must be >= 1$"):
        spec_from_dict({**BASE, "num_heads": 0}, source=HStr("api"))


@pytest.mark.parametrize("path", PATHS)
def test_rules_judge_the_plain_value_not_the_subclass_claims(path):
    # HInt(0) claims it is not below 1, and its __int__ says 1000: the stored value is 0
    with pytest.raises(SpecError, match=r"num_heads = 0: must be >= 1"):
        _build(path, {"num_heads": HInt(0)})
    with pytest.raises(SpecError, match=r"head_dim = 1000: must be a multiple of 8"):
        _build(path, {"head_dim": HInt(1000)})
    with pytest.raises(SpecError, match=r"dtype = \"float64\": must be one of"):
        _build(path, {"dtype": HStr("float64")})      # equals every string, holds float64
    with pytest.raises(SpecError, match=r"name = \"no\\nname\": must match"):
        _build(path, {"name": HStr("no\nname")})
    with pytest.raises(SpecError, match=r"softmax_scale = 0.0: must be a finite number"):
        _build(path, {"softmax_scale": HFloat(0.0)})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field,cls", [("num_heads", int), ("head_dim", int), ("causal", bool),
                                       ("dtype", str), ("softmax_scale", float),
                                       ("name", str), ("head_offsets", str)])
def test_object_claiming_a_plain_class_is_refused(field, cls, path):
    assert isinstance(Claims(cls), cls)              # what isinstance believes
    with pytest.raises(SpecError, match=rf"{field} = .*: must "):
        _build(path, {field: Claims(cls)})
    with pytest.raises(SpecError, match=r"segment_lengths\[0\] = .*: must be an integer"):
        _build(path, {"segment_lengths": [Claims(int), 32]})


@pytest.mark.parametrize("path", PATHS)
def test_list_subclass_gives_what_it_holds(path):
    spec = _build(path, {"segment_lengths": HList([16, 32]), "dilation_rates": HList([1, 2])})
    assert type(spec.segment_lengths) is tuple and spec.segment_lengths == (16, 32)
    assert spec.dilation_rates == (1, 2)
    _assert_spec_plain(spec)
    with pytest.raises(SpecError, match="must have at most 16 branches"):
        _build(path, {"segment_lengths": HList([16] * 17), "dilation_rates": HList([1] * 17)})


def test_dict_subclass_gives_what_it_holds():
    class HDict(dict):
        def __iter__(self): return iter(["name"])
        def keys(self): return ["name"]
        def items(self): return [("name", HStr("x"))]
        def __getitem__(self, key): return HInt(8)
        def get(self, key, default=None): return HInt(8)
    spec = spec_from_dict(HDict({**BASE, "hilbert": HDict({"scope": "segment"})}))
    _assert_spec_plain(spec)
    assert spec == Spec(**BASE, hilbert={"scope": "segment"})


@pytest.mark.parametrize("case", sorted(CASES))
def test_pickle_and_copy_rebuild_through_the_constructor(case):
    clean_fields, hostile_fields = CASES[case]
    clean = Spec(**{**BASE, **clean_fields})
    for spec in (pickle.loads(pickle.dumps(clean)), copy.copy(clean), copy.deepcopy(clean)):
        _assert_spec_plain(spec)
        assert spec == clean and spec.key() == clean.key() and type(spec) is Spec
    spec = _build("pickle", hostile_fields)
    _assert_spec_plain(spec)
    assert spec.key() == clean.key() and _source(spec) == _source(clean)


def _crafted_pickle(state) -> bytes:
    """A pickle that makes a bare Spec (Spec.__new__(Spec)) and sets its state, as the
    default object protocol writes it: PROTO 2, GLOBAL, EMPTY_TUPLE, NEWOBJ, state, BUILD."""
    body = pickle.dumps(state, protocol=2)
    assert body[:2] == b"\x80\x02" and body[-1:] == b"."
    return b"\x80\x02cdilgen.spec\nSpec\n)\x81" + body[2:-1] + b"b."


def _state(**changes) -> dict:
    spec = Spec(**BASE)
    return {**{f.name: getattr(spec, f.name) for f in dataclasses.fields(Spec)}, **changes}


def test_crafted_pickle_is_validated_like_the_constructor():
    assert pickle.loads(_crafted_pickle(_state())) == Spec(**BASE)
    with pytest.raises(SpecError) as from_constructor:
        Spec(**{**BASE, "name": "evil\nname"})
    with pytest.raises(SpecError) as from_pickle:
        pickle.loads(_crafted_pickle(_state(name="evil\nname")))
    assert str(from_pickle.value) == str(from_constructor.value)
    assert str(from_pickle.value).startswith('<spec>: name = "evil\\nname": must match')
    with pytest.raises(SpecError, match=r"num_heads = 0: must be >= 1"):
        pickle.loads(_crafted_pickle(_state(num_heads=0)))
    with pytest.raises(SpecError, match=r"foo = 1: unknown field"):
        pickle.loads(_crafted_pickle(_state(foo=1)))
    spec = pickle.loads(_crafted_pickle(_state(num_heads=HInt(8), name=HStr("plain_attn"))))
    _assert_spec_plain(spec)
    assert spec == Spec(**BASE)


def test_crafted_pickle_with_a_state_that_is_not_a_dict_is_refused():
    body = pickle.dumps((None, {"name": "x"}), protocol=2)
    with pytest.raises(SpecError, match=r"^<pickle>: a Spec's state must be a dict"):
        pickle.loads(b"\x80\x02cdilgen.spec\nSpec\n)\x81" + body[2:-1] + b"b.")


def test_codegen_refuses_a_value_that_is_not_plain():
    # a Spec mutated past its validation: the key stays clean, the template would not
    spec = Spec(**BASE)
    clean_key, clean_source = spec.key(), _source(spec)
    object.__setattr__(spec, "head_dim", HInt(64))
    assert spec.key() == clean_key
    with pytest.raises(TypeError, match=r"^plan\.spec\['head_dim'\] is a .*HInt: only int"):
        _source(spec)
    good = plan(Spec(**BASE), get_target("sm90"))
    assert emit(good) == clean_source
    bad = dataclasses.replace(good, spec={**good.spec, "name": HStr("plain_attn")})
    with pytest.raises(TypeError, match=r"^plan\.spec\['name'\] is a .*HStr"):
        emit(bad)
    bad = dataclasses.replace(good, branches=(dataclasses.replace(good.branches[0],
                                                                  dilation=HInt(1)),) + good.branches[1:])
    with pytest.raises(TypeError, match=r"^plan\.branches\[0\]\.dilation is a "):
        emit(bad)
