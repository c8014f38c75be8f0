"""bound_onednn_caches caps oneDNN's and ideep's per-shape caches unless the user chose a capacity."""

from kvpilot.model.onednn_caches import CACHE_CAPACITY_VARIABLES, DEFAULT_CACHE_CAPACITY, bound_onednn_caches


def test_unset_variables_get_the_default_capacity() -> None:
    env: dict[str, str] = {}
    assert bound_onednn_caches(environ=env) == {name: str(DEFAULT_CACHE_CAPACITY) for name in CACHE_CAPACITY_VARIABLES}
    assert env == {name: str(DEFAULT_CACHE_CAPACITY) for name in CACHE_CAPACITY_VARIABLES}


def test_a_value_the_user_set_is_kept() -> None:
    env = {"LRU_CACHE_CAPACITY": "1024"}
    in_force = bound_onednn_caches(64, environ=env)
    assert in_force == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "1024"}
