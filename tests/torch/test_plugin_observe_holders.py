"""Model-local KV outside transformers caches (plugin/observe/holders.py, rules 1 and 3): what a declaring owner holds
in its own state counts to the byte, and nothing else it holds does; a layer-stacked K/V store of a module that
declares nothing is that module's, and its other buffers are not. The decoys are what real owners keep beside their KV
(vllm-omni's VibeVoice root: the pool's int32 block table, the attention layers the pool drives, its config; any
module: parameters, rotary buffers, submodules with their own state). vllm-omni 0.32's real classes are measured in
tests/omni/test_real_classes_032.py (rule 1 on VibeVoice, rule 2 on MiniCPM-o)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from kv_exporter.cachebytes import measure_cache_bytes
from kv_exporter.manifest import Declaration
from kv_exporter.observation import UNATTRIBUTED_OWNER
from kv_exporter.plugin import observe
from kv_exporter.protocol import ModelLocalKVScope, ModelLocalKVSpec, RowDriver
from tests.support.observing import by_owner, observer, sample

__all__ = ["observer"]  # the fixture, imported for pytest

LAYERS, KV_HEADS, HEAD_DIM, SLOTS, PAGE = 2, 2, 16, 4, 16
DTYPE = torch.bfloat16


def spec(dtype: torch.dtype = DTYPE) -> ModelLocalKVSpec:
    return ModelLocalKVSpec(
        name="negative_pool",
        layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=dtype,
        physical_capacity_positions=PAGE,
        capacity_source="one page per slot",
        scope=ModelLocalKVScope.MODEL,
        rows=RowDriver.MAX_NUM_SEQS,
    )


class Attention(nn.Module):
    """Stands where vLLM's attention layer stands: the engine's paged KV bound on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, dtype=DTYPE)
        self.kv_cache = [torch.zeros(8, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=DTYPE)]


class Pool:
    """A plain object as VibeVoiceNegativeKV is: KV pages per layer, an int32 table, the layers it drives."""

    def __init__(self, layers: list[Attention]) -> None:
        shape = (SLOTS, KV_HEADS, PAGE, 2 * HEAD_DIM)
        self.kv_caches = [torch.empty(shape, dtype=DTYPE) for _ in range(LAYERS)]
        self.block_tables = torch.arange(SLOTS, dtype=torch.int32).reshape(SLOTS, 1)
        self.attention_layers = layers
        self.config = SimpleNamespace(block_size=PAGE, max_num_seqs=SLOTS)


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention() for _ in range(LAYERS)])
        self.embed = nn.Parameter(torch.zeros(64, KV_HEADS * HEAD_DIM, dtype=DTYPE))  # KV-shaped: never counted
        self.register_buffer("inv_freq", torch.ones(HEAD_DIM // 2), persistent=False)
        self.negative_kv = Pool(list(self.layers))
        self.first_page = self.negative_kv.kv_caches[0][0]  # a view into the pool: counted once
        self.positions = torch.zeros(SLOTS, dtype=torch.int64)


def declarations(owner: str = "", dtype: torch.dtype = DTYPE) -> list[Declaration]:
    return [Declaration.from_spec(owner, spec(dtype))]


def pool_bytes(root: Root) -> int:
    return sum(t.untyped_storage().nbytes() for t in root.negative_kv.kv_caches)


@pytest.mark.usefixtures("observer")
def test_a_declaring_owners_pool_counts_to_the_byte_and_nothing_beside_it_does() -> None:
    root = Root()
    observe.attach(root, declarations(), torch.device("cpu"))
    owners = by_owner(sample())
    pool = pool_bytes(root)
    assert (owners[""].bytes, owners[""].caches, owners[""].peak_bytes) == (pool, 1, pool)
    assert set(owners) == {""}  # the attention layers' paged KV, the table, the parameter: nobody's


@pytest.mark.usefixtures("observer")
def test_only_a_declared_dtype_counts() -> None:
    root = Root()
    observe.attach(root, declarations(dtype=torch.float16), torch.device("cpu"))
    assert by_owner(sample())[""].bytes == 0


@pytest.mark.usefixtures("observer")
def test_the_engines_paged_kv_never_counts_wherever_a_declaring_owner_holds_it() -> None:
    root = Root()
    attention = root.layers[0]
    # A declaring module holding the engine's KV (vLLM binds it as `kv_cache`): KV-shaped, in the declared dtype.
    observe.attach(root, declarations(owner="layers.0"), torch.device("cpu"), engine_kv=attention.kv_cache)
    assert by_owner(sample())["layers.0"].bytes == 0
    # Told nothing of the engine's KV, rule 1 would count it: why publish passes the runner's kv_caches.
    observe.attach(root, declarations(owner="layers.0"), torch.device("cpu"))
    assert by_owner(sample())["layers.0"].bytes == attention.kv_cache[0].untyped_storage().nbytes()


@pytest.mark.usefixtures("observer")
def test_a_cache_the_owner_keeps_is_the_trackers_and_counted_once() -> None:
    root = Root()
    cache = DynamicCache()
    keys = torch.randn(1, KV_HEADS, 3, HEAD_DIM).to(DTYPE)
    cache.update(keys, keys.clone(), 0)
    root.cache = cache
    root.alias = cache.layers[0].keys  # the cache's own tensor, seen again through the owner's state
    observe.attach(root, declarations(), torch.device("cpu"))
    owners = by_owner(sample())
    assert owners[UNATTRIBUTED_OWNER].bytes == measure_cache_bytes(cache).allocated_bytes  # made outside the model
    assert owners[""].bytes == pool_bytes(root)


# -- rule 3: raw stores of modules that declare nothing --------------------------------------------------------------

HEADS, POSITIONS, BATCH = 4, 5, 3  # 4 heads to 2 KV heads, as the fast-AR checkpoints


class FastAR(nn.Module):
    """Stands where vllm-omni's fish_speech / audio8 fast-AR predictor stands: its own attention config, and after
    a forward K and V stores for every layer at once beside buffers that are not KV."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM
        )
        self.proj = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)
        self.k_store: torch.Tensor | None = None
        self.v_store: torch.Tensor | None = None

    def allocate(self) -> None:
        self.k_store = torch.empty(LAYERS, BATCH, KV_HEADS, POSITIONS, HEAD_DIM)
        self.v_store = torch.empty_like(self.k_store)
        self.hidden = torch.zeros(LAYERS, BATCH, POSITIONS, HEADS * HEAD_DIM)  # hidden states per layer: not KV
        self.positions = torch.zeros(LAYERS, BATCH, KV_HEADS, POSITIONS, HEAD_DIM, dtype=torch.int64)  # not floating
        self.per_layer = [torch.empty(BATCH, KV_HEADS, POSITIONS, HEAD_DIM)]  # no layer count: not this rule's
        self.stacked = nn.Parameter(torch.zeros(LAYERS, KV_HEADS, 1, HEAD_DIM))  # a parameter: never
        # A plain object keeping K and V side by side for every layer (Qwen3-TTS's FrameLocalKVCache), beside the
        # module it drives (never entered: a module has its own figures).
        self.frame = SimpleNamespace(buffer=torch.empty(LAYERS, 2, BATCH, KV_HEADS, POSITIONS, HEAD_DIM), model=self)


class Talker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fast_ar = FastAR()


@pytest.mark.usefixtures("observer")
def test_a_layer_stacked_store_of_a_module_that_declares_nothing_is_its_own_to_the_byte() -> None:
    root = Talker()
    observe.attach(root, [], torch.device("cpu"))
    assert by_owner(sample()).get("fast_ar") is None  # nothing allocated yet
    root.fast_ar.allocate()
    fast_ar = root.fast_ar
    assert fast_ar.k_store is not None and fast_ar.v_store is not None
    stores = [fast_ar.k_store, fast_ar.v_store, fast_ar.frame.buffer]
    owners = by_owner(sample())
    assert (owners["fast_ar"].bytes, set(owners)) == (sum(t.untyped_storage().nbytes() for t in stores), {"fast_ar"})
    fast_ar.k_store = fast_ar.v_store = fast_ar.frame = None  # released: let go at the next sample
    assert by_owner(sample())["fast_ar"].bytes == 0


@pytest.mark.usefixtures("observer")
def test_a_declaring_module_is_left_to_rule_1() -> None:
    root = Talker()
    root.fast_ar.allocate()
    # Declared in bfloat16: its float32 stores are no evidence for rule 1, and rule 3 leaves a declaring module alone.
    observe.attach(root, declarations(owner="fast_ar"), torch.device("cpu"))
    assert by_owner(sample())["fast_ar"].bytes == 0


# -- rule 4: per-layer stores whose names say K/V, in the heads the modules name ---------------------------------------


class CacheModule(nn.Module):
    """Stands where fish_speech's DAC `KVCache` stands: K and V buffers, no head count of its own (its attention
    names them)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(BATCH, KV_HEADS, POSITIONS, HEAD_DIM))
        self.register_buffer("v_cache", torch.zeros(BATCH, KV_HEADS, POSITIONS, HEAD_DIM))


class NamedAttention(nn.Module):
    """An attention naming its heads, as fish's DAC and moss_tts's attentions do, holding per-layer stores: a ring in
    a plain object of a streaming state (moss_tts), a fused-heads ring in a dict (Qwen3-TTS), and the decoys beside
    them; a cache module once set up after load."""

    def __init__(self) -> None:
        super().__init__()
        self.n_local_heads, self.head_dim = KV_HEADS, HEAD_DIM
        self.kv_cache: CacheModule | None = None  # fish's DAC attention: a KVCache module once `setup_caches` ran
        ring = SimpleNamespace(cache=torch.zeros(2, BATCH, KV_HEADS, POSITIONS, HEAD_DIM), context=POSITIONS)
        self._streaming_state = SimpleNamespace(kv_cache=ring, offsets=torch.zeros(BATCH))
        self.layer = {
            "k_ring": torch.zeros(BATCH, POSITIONS, KV_HEADS * HEAD_DIM),
            "prev": torch.zeros(BATCH, POSITIONS, KV_HEADS * HEAD_DIM),  # a convolution's history: no K/V name
        }
        self.k = torch.zeros(BATCH, KV_HEADS, HEAD_DIM)  # a scratch buffer: a K word alone is no store
        self.kv_positions = torch.zeros(BATCH, KV_HEADS, POSITIONS, HEAD_DIM, dtype=torch.int64)  # not floating
        self.kv_hidden = torch.zeros(BATCH, POSITIONS, 3 * HEAD_DIM)  # no head size, no heads x head size
        self.config = SimpleNamespace(past=torch.zeros(BATCH, KV_HEADS, POSITIONS, HEAD_DIM))  # a config: never


class StreamingTransformer(nn.Module):
    """Stands where personaplex's mimi transformer stands: its layers name the heads, it keeps a ring per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NamedAttention() for _ in range(LAYERS))
        self._kv = [SimpleNamespace(cache=torch.zeros(2, BATCH, KV_HEADS, POSITIONS, HEAD_DIM)) for _ in range(LAYERS)]


class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = StreamingTransformer()
        self.unnamed = SimpleNamespace(past_key_values=torch.zeros(BATCH, KV_HEADS, POSITIONS, HEAD_DIM))


def storage_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.usefixtures("observer")
def test_a_per_layer_store_named_kv_in_named_heads_is_its_modules_to_the_byte() -> None:
    root = Codec()
    observe.attach(root, [], torch.device("cpu"))
    owners = by_owner(sample())
    transformer = root.transformer
    expected = {"transformer": storage_bytes(*(ring.cache for ring in transformer._kv))}
    for i, attention in enumerate(transformer.layers):
        assert isinstance(attention, NamedAttention)
        expected[f"transformer.layers.{i}"] = storage_bytes(
            attention._streaming_state.kv_cache.cache, attention.layer["k_ring"]
        )
    # The root names no heads itself, the attention below it does: its `past_key_values` in those heads is its own.
    expected[""] = storage_bytes(root.unnamed.past_key_values)
    assert {owner: o.bytes for owner, o in owners.items() if o.bytes} == expected
    transformer._kv = None  # released: let go at the next sample
    assert by_owner(sample())["transformer"].bytes == 0


@pytest.mark.usefixtures("observer")
def test_names_alone_or_shape_alone_are_no_evidence() -> None:
    root = Codec()
    attention = root.transformer.layers[0]
    assert isinstance(attention, NamedAttention)
    attention.layer["k_ring"] = torch.zeros(BATCH, POSITIONS, 3 * HEAD_DIM)  # a K/V name, no heads in its shape
    del attention._streaming_state  # leaves the history: the heads' shape, no K/V name
    observe.attach(root, [], torch.device("cpu"))
    assert "transformer.layers.0" not in by_owner(sample())


@pytest.mark.usefixtures("observer")
def test_a_declaring_module_and_a_vllm_attention_layer_are_never_looked_at_by_rule_4() -> None:
    root = Codec()
    attention = root.transformer.layers[1]
    attention.get_kv_cache_spec = lambda: None  # what marks vLLM's attention layers, which hold the engine's KV
    observe.attach(root, declarations(owner="transformer"), torch.device("cpu"))
    owners = by_owner(sample())
    assert owners["transformer"].bytes == 0  # declared bf16 K/V, holds float32 rings: rule 1 finds nothing
    assert "transformer.layers.1" not in owners and owners["transformer.layers.0"].bytes > 0


@pytest.mark.usefixtures("observer")
def test_a_cache_module_made_after_load_under_an_attention_naming_heads_is_seen() -> None:
    """fish_speech's DAC attention gets its KVCache module (no forward of its own) from `setup_caches`, whenever a
    caller calls it: seen under the attention's heads, before and after the tree is read again."""
    root = Codec()
    attention = root.transformer.layers[0]
    assert isinstance(attention, NamedAttention)
    observe.attach(root, [], torch.device("cpu"))
    assert "transformer.layers.0.kv_cache" not in by_owner(sample())
    attention.kv_cache = CacheModule()
    expected = storage_bytes(attention.kv_cache.k_cache, attention.kv_cache.v_cache)
    assert by_owner(sample())["transformer.layers.0.kv_cache"].bytes == expected
    observe.attach(root, [], torch.device("cpu"))  # the hook attaches again at each publication: still its state
    owners = by_owner(sample())
    assert owners["transformer.layers.0.kv_cache"].bytes == storage_bytes(
        attention.kv_cache.k_cache, attention.kv_cache.v_cache
    )
