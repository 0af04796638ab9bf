"""Public Python API: target + draft head + n-gram trie in one call.

For people coming from the research code::

    from dart_core import DartModel

    model = DartModel.from_pretrained()                 # SmolLM2 + shipped head + default trie, if found
    out = model.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
    print(out[0].text, out.tau)
    for chunk in model.generate("def fib(n):", stream=True):
        print(chunk.text, end="")

Everything is local: a model folder or ``.gguf`` file, a head folder
(``config.json`` + ``model.safetensors``), a trie file.  No hub access.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch

from dart_core.model.allocator import keep_freed_memory
from dart_core.spec.budget import AdaptiveBudget, SpeculationGate, VerifyCostCurve, curve_shapes
from dart_core.serve.detokenizer import IncrementalDetokenizer
from dart_core.spec.draft_head import DartDraftHead, DraftHeadConfig, load_draft_head
from dart_core.spec.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, load_eagle3_head
from dart_core.step.engine import DartEngine, GenerationResult
from dart_core.step.grammar import Grammar, GrammarCompiler, GrammarSpec
from dart_core.model.kernel_config import KernelConfig
from dart_core.model.quant import can_int4, default_kernel, q8_0_kernel, quantize_linears
from dart_core.model.rows import can_pack, pack_linears
from dart_core.step.sampling import SamplingParams
from dart_core.spec.routing import RoutedDrafter
from dart_core.spec.speculative import SpeculativeConfig
from dart_core.model.target import TargetModel
from dart_core.model.tokenizer import DEFAULT_MODEL, resolve_model, tokenizer_identity
from ngram_service.cache import default_trie_path
from ngram_service.client import InProcessTreeSearch, TreeSearchClient
from ngram_service.convert import resolve_ngram_model
from ngram_service.tokenizer import TrieTokenizer
from ngram_service.trie import NgramTrie
from ngram_service.tree_search import SearchParams

logger = logging.getLogger(__name__)

__all__ = ["DartModel", "Completion", "GenerateOutput", "StreamChunk", "SHIPPED_HEADS", "SHIPPED_EAGLE3_HEADS",
           "DRAFT_WEIGHTS", "default_weights",
           "default_draft_weights", "resolve_draft_weights", "eagle3_drafter"]

Message = dict  # {"role": ..., "content": ...}
Prompt = Union[str, Sequence[int], Sequence[Message]]

#: Heads shipped inside the package, by target model name.
SHIPPED_HEADS = {DEFAULT_MODEL: Path(__file__).parent / "heads" / DEFAULT_MODEL}
#: EAGLE-3 heads shipped inside the package (for method eagle3 and ``eagle3_head="auto"``), by target model name.
SHIPPED_EAGLE3_HEADS = {DEFAULT_MODEL: Path(__file__).parent / "heads" / f"{DEFAULT_MODEL}-eagle3"}


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"


class GenerateOutput(list):
    """A list of :class:`Completion` (one per input) with the run's statistics."""

    def __init__(self, completions: list[Completion], result: GenerationResult) -> None:
        super().__init__(completions)
        self.result = result

    @property
    def tau(self) -> float:
        return self.result.tau


@dataclass(frozen=True)
class StreamChunk:
    index: int  # which input
    token_ids: list[int]  # new tokens
    text: str  # new text (decoded incrementally)
    finish_reason: str | None


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX, through oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def default_draft_dtype(target: TargetModel) -> torch.dtype:
    """The draft head's dtype: the target's, or bfloat16 beside a float32 target on a CPU that
    multiplies bf16 matrices natively, where a float32 head costs more per draft (docs/engine.md, "Draft dtype")."""
    if target.device.type == "cpu" and target.dtype == torch.float32 and native_bf16_cpu():
        return torch.bfloat16
    return target.dtype


#: the values of ``DartModel.from_pretrained(draft_weights=...)``
DRAFT_WEIGHTS = ("auto", "dense", "q8_0")


def default_draft_weights(target: TargetModel) -> str:
    """``draft_weights="auto"``: ``"q8_0"`` beside a float32 CPU target where a qmm kernel runs
    vectorised (:func:`dart_core.model.quant.q8_0_kernel`: ``qmm`` with AVX-512, ``qmm-a8`` with AVX2),
    where the head's weights read from memory after each target forward are half their bf16 bytes
    and, with AVX2 only, a draft costs less than with a dense float32 head (docs/engine.md, "Draft
    weights"; ``bench/results/avx2_kernel/``); ``"dense"`` otherwise."""
    on_cpu = target.device.type == "cpu" and target.dtype == torch.float32
    return "q8_0" if on_cpu and q8_0_kernel() is not None else "dense"


def resolve_draft_weights(draft_weights: str, target: TargetModel, draft_dtype: torch.dtype | None = None) -> str:
    """``draft_weights`` checked, with ``"auto"`` resolved: ``"dense"`` when ``draft_dtype`` is given
    (a dtype is a choice of dense weights), else :func:`default_draft_weights`.

    Raises:
        ValueError: an unknown value; ``"q8_0"`` off the CPU, on a CPU without AVX-512 or AVX2, or with a
            ``draft_dtype`` other than float32 (its layers take float32 inputs)."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, not {draft_weights!r}")
    if draft_weights == "auto":
        return "dense" if draft_dtype is not None else default_draft_weights(target)
    if draft_weights == "q8_0" and (target.device.type != "cpu" or q8_0_kernel() is None):
        raise ValueError("draft_weights='q8_0' runs on a CPU with AVX-512 (the qmm kernel) or AVX2 (qmm-a8) only")
    if draft_weights == "q8_0" and draft_dtype not in (None, torch.float32):
        raise ValueError(f"draft_weights='q8_0' computes in float32; draft_dtype={draft_dtype} needs dense weights")
    return draft_weights


def eagle3_drafter(head: str | Path | None, target: TargetModel, *, draft_weights: str = "auto",
                   draft_dtype: torch.dtype | None = None, total_tokens: int = 60, depth: int = 7,
                   top_k: int = 10) -> Eagle3Drafter:
    """An :class:`~dart_core.spec.eagle3.Eagle3Drafter` on ``target`` (``method="eagle3"``): the
    EAGLE-3 head in ``head`` (:func:`~dart_core.spec.eagle3.load_eagle3_head`); None or ``"auto"``
    for the one shipped for the target (:data:`SHIPPED_EAGLE3_HEADS`); ``"random"`` for one of the
    target's shape with torch's default initialisation, seeded (tests).  Its linear layers as the
    DART head's are (:func:`resolve_draft_weights`: Q8_0 blocks on a CPU with AVX-512 or AVX2), in
    ``draft_dtype`` or the target's dtype otherwise.

    Raises:
        ValueError: no ``head`` and none shipped for the target; a ``draft_weights`` :func:`resolve_draft_weights`
            refuses; tree sizes :class:`~dart_core.spec.eagle3.Eagle3Drafter` refuses.
        HeadLoadError: as :func:`~dart_core.spec.eagle3.load_eagle3_head`."""
    q8 = resolve_draft_weights(draft_weights, target, draft_dtype) == "q8_0"
    dtype = torch.float32 if q8 else draft_dtype or target.dtype
    if head == "random":
        torch.manual_seed(0)
        eagle = Eagle3Head(Eagle3Config.for_target(target.config)).to(device=target.device, dtype=dtype).eval()
    else:
        if head in (None, "auto"):
            name = getattr(target.tokenizer, "dart_model_name", DEFAULT_MODEL)
            head = SHIPPED_EAGLE3_HEADS.get(name)
            if head is None or not (head / "config.json").is_file():
                raise ValueError(f"method eagle3 needs an EAGLE-3 head folder (head=...): none ships for {name}")
        eagle = load_eagle3_head(head, target.config, device=target.device, dtype=dtype)
    if q8:  # Q8_0 blocks run by the qmm kernel, as the DART head's
        logger.info("quantised %d linear layers of the EAGLE-3 head to Q8_0", quantize_linears(eagle))
    return Eagle3Drafter(eagle, target.embed_tokens, total_tokens=total_tokens, depth=depth, top_k=top_k)


def default_weights(model: str | None = None, *, dtype: torch.dtype | None = None, device: str | None = None,
                    device_map=None) -> str:
    """``DartModel.from_pretrained``'s ``weights="auto"``: ``"gguf-native"`` for a GGUF model (the
    embedded default included) loaded on the CPU with float32 (or default) dtype and no
    ``device_map``, where PyTorch has the CPU int4 kernel; ``"dense"`` otherwise.  The 4-bit
    target decodes faster than the float32 one on the AVX2-only CPU measured, autoregressively and
    with DART (``bench/results/gguf_native/``)."""
    on_cpu = torch.device(device or "cpu").type == "cpu"
    if not on_cpu or device_map is not None or dtype not in (None, torch.float32) or not can_int4():
        return "dense"
    return "gguf-native" if resolve_model(model).gguf_file else "dense"


def _alias(value, reference_value, name: str, reference_name: str, default):
    """``value``, or the same argument given under the DART reference's name."""
    if reference_value is None:
        return value
    if value != default:
        raise TypeError(f"from_pretrained got both {name}= and {reference_name}= (one argument under two names)")
    return reference_value


class DartModel:
    """A DART engine with its tokenizer (see :meth:`from_pretrained`)."""

    def __init__(self, engine: DartEngine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None  # made at the first compile_grammar

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        head: str | Path | None = None,
        trie: str | Path | None = "auto",
        *,
        dtype: torch.dtype | None = None,
        weights: str = "auto",
        gguf_kernel: str = "auto",
        draft_dtype: torch.dtype | None = None,
        draft_weights: str = "auto",
        device: str | None = None,
        device_map=None,
        search_params: SearchParams | None = None,
        budget: int | str = "auto",
        tree_search: TreeSearchClient | None = None,
        base_model_name_or_path: str | None = None,
        dart_model_name_or_path: str | Path | None = None,
        ngram_model_name_or_path: str | Path | None = None,
        is_small_ngram: bool = False,
        cuda_graphs: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        kernel_config: KernelConfig | None = None,
        eagle3_head: str | Path | None = None,
    ) -> "DartModel":
        """Loads everything from local files.

        The DART reference's call, ``from_pretrained(base_model_name_or_path=...,
        dart_model_name_or_path=..., ngram_model_name_or_path=...)`` (or the same three
        positionally), works as it is: those names are aliases of ``model``, ``head`` and
        ``trie``, and a reference head or n-gram model drafts as in the reference (its head's weights
        as given with ``draft_weights="dense"`` and ``draft_dtype=torch.float32``; the CPU defaults,
        Q8_0 or bf16 head layers, draft close to the reference's drafts, not equal: output is exact
        either way).

        Args:
            model: None for the embedded SmolLM2-135M-Instruct, a model folder or a .gguf file.
            head: a draft-head folder (dart-serve's or the reference's layout); None for the
                head shipped for this model (decoding is autoregressive, with a warning, when
                there is none); ``"random"`` for a randomly initialised head (lossless, τ ≈ 1).
                With ``SpeculativeConfig(method="eagle3")`` an EAGLE-3 head folder in the published
                layout (:func:`~dart_core.spec.eagle3.load_eagle3_head`), ``"random"``, or None for
                the one shipped for the model (:data:`SHIPPED_EAGLE3_HEADS`; refused where none
                ships); with ``method="none"`` no head is loaded (autoregressive decoding).
            trie: an n-gram model: a dart-serve trie file; a reference ``.trie`` file, or a
                reference n-gram folder holding ``full.trie`` (``small.trie`` with
                ``is_small_ngram``), converted once into the cache and then memory-mapped
                (:func:`ngram_service.convert.resolve_ngram_model`); ``"auto"`` uses the
                default trie in the cache when it has been built (``python -m
                ngram_service.build``); None for the logits-only tree search.
            dtype: the target's; default bfloat16 on CUDA, float32 on CPU.
            weights: the target's weight format: ``"dense"`` (de-quantised to ``dtype``),
                ``"gguf-native"`` (a GGUF's 4-bit blocks run as they are, CPU only:
                :func:`dart_core.model.quant.quantize_from_gguf`) or ``"auto"``: :func:`default_weights`.
            gguf_kernel: the kernel of GGUF-native layers (``"qmm-a8"``: 8-bit activations, llama.cpp's
                arithmetic, the cheapest verification per query token; ``"qmm"``: float32
                activations, the de-quantised model's text; ``"aten"``: PyTorch's int4 kernel) or
                ``"auto"``: :func:`dart_core.model.quant.default_kernel` (``qmm-a8`` with AVX-512
                VNNI or AVX2, else ``aten``). Ignored when the weights are dense.
            draft_dtype: the draft head's; default the target's, except bfloat16
                beside a float32 target on a CPU with native bf16 matrix
                multiplication (AVX512-BF16 / AMX; figures in docs/engine.md).  Output is
                exact either way: the target verifies.
            draft_weights: the draft head's linear layers: ``"dense"`` (``draft_dtype``),
                ``"q8_0"`` (quantised to Q8_0 blocks at load and run by the float32 qmm kernel
                with AVX-512, by qmm-a8 with AVX2 only; CPU only:
                :func:`dart_core.model.quant.quantize_linears`; the rest of the head in float32) or ``"auto"``: ``"dense"`` when ``draft_dtype`` is given, else
                :func:`default_draft_weights`.  Output is exact either way.
            device: default CUDA when available; ignored with ``device_map``. A CPU target also
                keeps freed tensor memory mapped for reuse (:func:`~dart_core.model.allocator.keep_freed_memory`).
            device_map: forwarded to transformers/accelerate for targets larger than one device.
            budget: ``"auto"`` measures verification cost at start-up, adapts the
                tree size per step (:class:`~dart_core.spec.budget.AdaptiveBudget`) and, per
                batch size, speculates only while speculative steps measure faster than
                autoregressive ones (:class:`~dart_core.spec.budget.SpeculationGate`); an int
                fixes the number of draft nodes per tree and always speculates.
            tree_search: a tree-search client to use instead of the in-process one.
            base_model_name_or_path, dart_model_name_or_path, ngram_model_name_or_path:
                the reference's names for ``model``, ``head`` and ``trie`` (local paths only).
            is_small_ngram: with a reference n-gram folder, use its ``small.trie``.
            cuda_graphs: on CUDA, verify over a static KV cache with padded tree and batch
                sizes, each (batch bucket, size bucket) captured once as a CUDA graph and replayed
                (:class:`~dart_core.model.cuda_graphs.StaticVerifier`; the verification cost curve
                is then measured with the graphs), and draft likewise over a static head KV cache
                (:class:`~dart_core.model.cuda_graphs.StaticDrafter`;
                ``SpeculativeConfig.draft_graphs=False`` keeps the draft eager, for comparisons).  Off by default,
                since it is refused off CUDA; on a GPU turn it on (``bench/results/gpu/``, measures
                both).
            speculative_config: every speculation setting in one object
                (:class:`~dart_core.spec.speculative.SpeculativeConfig`: budget, tree search, context,
                lookup steps, gate, prefill grouping, CUDA graphs); instead of ``search_params``,
                ``budget`` and ``cuda_graphs``, which build one when it is not given.
            kernel_config: the kernel and memory switches (:class:`~dart_core.model.kernel_config.KernelConfig`:
                SDPA backends, grouped-query attention, static-cache windows, freed CPU memory kept);
                None: its defaults. Both configs are logged at start-up.
            eagle3_head: with method dart, an EAGLE-3 head folder (``"auto"``: the one shipped for the
                model; ``"random"``) loaded beside the
                DART head, sized by the config's ``eagle3_*`` fields: each sequence is then drafted by
                the method its request names (``NewSequence.method``, the serving API's ``"method"``
                field; :class:`~dart_core.spec.routing.RoutedDrafter`), DART by default, and every
                tree is verified in the same forward. None: DART alone.

        Raises:
            TypeError: a value given under both its name and its reference alias, or
                ``speculative_config`` together with ``search_params``, ``budget`` or ``cuda_graphs``.
            FileNotFoundError: a path does not exist.
            ReferenceTrieError: a reference n-gram file that is truncated or inconsistent.
            HeadLoadError: the head does not fit the target.
            TokenizerMismatchError: the trie was built with another tokenizer.
            ValueError: ``cuda_graphs`` off CUDA; method eagle3 without a head; ``eagle3_head`` with a
                method other than dart, or where no DART head is loaded; an unknown
                ``weights``, or "gguf-native" where it does not apply (see
                :meth:`TargetModel.from_pretrained`); an unknown ``draft_weights``, or "q8_0" off the
                CPU, without AVX-512 or AVX2, or with a non-float32 ``draft_dtype``.
            GGUFWeightsError: a GGUF whose 4-bit blocks do not match its de-quantised weights.
        """
        if speculative_config is None:
            speculative_config = SpeculativeConfig(budget=budget, search=search_params or SearchParams(),
                                                   cuda_graphs=cuda_graphs)
        elif search_params is not None or budget != "auto" or cuda_graphs:
            raise TypeError("give the speculation settings either in speculative_config or as search_params / "
                            "budget / cuda_graphs, not both")
        spec = speculative_config
        budget, cuda_graphs = spec.budget, spec.cuda_graphs
        model = _alias(model, base_model_name_or_path, "model", "base_model_name_or_path", None)
        head = _alias(head, dart_model_name_or_path, "head", "dart_model_name_or_path", None)
        trie = _alias(trie, ngram_model_name_or_path, "trie", "ngram_model_name_or_path", "auto")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        if cuda_graphs and not str(device).startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, not {device}")
        if eagle3_head is not None and spec.method != "dart":
            raise ValueError(f"eagle3_head loads an EAGLE-3 head beside the DART head (method dart), not with method "
                             f"{spec.method} (method eagle3 takes its head as head=)")
        kernels = kernel_config or KernelConfig()
        logger.info("speculative config: %s; kernel config: %s", spec, kernels.as_dict())
        if str(device) == "cpu" and device_map is None and kernels.keep_freed_memory:
            keep_freed_memory()  # large per-step tensors reused, not faulted in again
        if weights == "auto":
            weights = default_weights(model, dtype=dtype, device=device, device_map=device_map)
        target = TargetModel.from_pretrained(model, dtype=dtype, device=device, device_map=device_map,
                                             weights=weights,
                                             gguf_kernel=None if gguf_kernel == "auto" or weights != "gguf-native"
                                             else gguf_kernel, kernels=kernels)
        if cuda_graphs:
            target.enable_static_cache()
        name = getattr(target.tokenizer, "dart_model_name", DEFAULT_MODEL)
        draft = drafter = None
        if spec.method == "eagle3":  # an EAGLE-3 head's dynamic trees instead of DART's head and search
            drafter = eagle3_drafter(head, target, draft_weights=draft_weights, draft_dtype=draft_dtype,
                                     total_tokens=spec.eagle3_total_tokens, depth=spec.eagle3_depth,
                                     top_k=spec.eagle3_top_k)
        elif spec.method == "dart":
            draft_weights = resolve_draft_weights(draft_weights, target, draft_dtype)
            draft = cls._load_head(head, name, target, torch.float32 if draft_weights == "q8_0"
                                   else draft_dtype or default_draft_dtype(target))
        if draft is not None and draft_weights == "q8_0":
            logger.info("quantised %d linear layers of the draft head to Q8_0", quantize_linears(draft))
        elif draft is not None and can_pack(draft):  # a float32 head on a CPU: oneDNN-packed like the target
            logger.info("packed %d linear layers of the draft head for oneDNN", pack_linears(draft))
        params = spec.search_params
        eos = target.tokenizer.eos_token_id if target.tokenizer is not None else None
        if params.eos_token_id < 0 and eos is not None:  # trees stop drafting past the end of the answer
            params = replace(params, eos_token_id=int(eos))
        if tree_search is None:
            tree_search = InProcessTreeSearch(cls._load_trie(trie, name, target.tokenizer, small=is_small_ngram))
        policy = gate = None
        if budget == "auto" and (draft is not None or drafter is not None):
            sizes, batches = curve_shapes(target.device, params.budget)
            policy = AdaptiveBudget(VerifyCostCurve.measure(target, node_counts=sizes, batch_sizes=batches),
                                    lookup_preference=spec.lookup_preference)
            gate = SpeculationGate(probe_every=spec.gate_probe_every, can_pay=policy.can_pay)
        if draft is not None:
            draft.use_kernels(kernels)
        if drafter is not None:  # the EAGLE-3 drafter sizes each draft to what the budget keeps
            drafter.budget = policy
        engine = DartEngine(target, draft, tree_search, params, budget=policy, gate=gate, drafter=drafter,
                            **spec.engine_kwargs())
        if cuda_graphs and draft is not None and spec.draft_graphs:
            engine.drafter.enable_static_draft()
        if eagle3_head is not None:  # both heads: each request names its drafter
            if engine.drafter is None:
                raise ValueError(f"eagle3_head is loaded beside a DART head, and none is loaded for {name}")
            eagle3 = eagle3_drafter(eagle3_head, target, draft_weights=draft_weights, draft_dtype=draft_dtype,
                                    total_tokens=spec.eagle3_total_tokens, depth=spec.eagle3_depth,
                                    top_k=spec.eagle3_top_k)
            eagle3.budget = policy
            engine.drafter = RoutedDrafter({"dart": engine.drafter, "eagle3": eagle3}, default="dart")
        return cls(engine, target.tokenizer)

    @staticmethod
    def _load_head(head, name: str, target: TargetModel, dtype: torch.dtype) -> DartDraftHead | None:
        if head == "random":
            h = DartDraftHead(DraftHeadConfig.for_target(target.config))
            h.reset_parameters(0)
            return h.to(device=target.device, dtype=dtype).eval()
        if head is None:
            shipped = SHIPPED_HEADS.get(name)
            if shipped is None or not (shipped / "config.json").is_file():
                logger.warning("no draft head for %s: decoding autoregressively (pass head=...)", name)
                return None
            head = shipped
        return load_draft_head(head, target.config, device=target.device, dtype=dtype).eval()

    @staticmethod
    def _load_trie(trie, name: str, tokenizer, *, small: bool = False) -> NgramTrie | None:
        if trie is None:
            return None
        if trie == "auto":
            path = default_trie_path(name, "default", 3)
            if not path.is_file():
                logger.info("no default trie at %s: logits-only tree search (build it with "
                            "`python -m ngram_service.build`)", path)
                return None
            trie = path
        else:  # ours as it is; the reference's file or folder converted once (cached)
            trie = resolve_ngram_model(trie, lambda: TrieTokenizer.wrap(tokenizer), small=small)
        loaded = NgramTrie(Path(trie).expanduser())
        loaded.check_tokenizer(tokenizer_identity(tokenizer)[1])
        return loaded

    # -- generation -----------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: ids as they are, text as is, chat messages through the chat template."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return list(self.tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"])
        return [int(t) for t in items]

    def _batch(self, inputs) -> list[list[int]]:
        single = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], (numbers.Integral, dict)))
        return [self.encode(inputs)] if single else [self.encode(p) for p in inputs]

    def sampling_params(self, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                        top_k: int = 0, seed: int | None = None, stop_token_ids: Sequence[int] | None = None,
                        logprobs: int | None = None, grammar: "Grammar | GrammarSpec | None" = None
                        ) -> SamplingParams:
        """:class:`SamplingParams` for this model: generation stops at its EOS token unless
        ``stop_token_ids`` says otherwise; ``grammar`` (structured output) is compiled here when
        given as a :class:`~dart_core.step.grammar.GrammarSpec` (see :meth:`compile_grammar`).

        Raises:
            ValueError: a value out of range; GrammarError (a ValueError) for a grammar that
                does not compile.
        """
        if isinstance(grammar, GrammarSpec):
            grammar = self.compile_grammar(grammar)
        return SamplingParams.stopping_at(
            self.tokenizer.eos_token_id, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, logprobs=logprobs, grammar=grammar,
            stop_token_ids=None if stop_token_ids is None else tuple(stop_token_ids))

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """Compiles a structured-output constraint for this model's tokenizer (cached by spec):
        ``model.sampling_params(grammar=model.compile_grammar(GrammarSpec.json_schema(schema)))``.

        Raises:
            GrammarError: as :meth:`~dart_core.step.grammar.GrammarCompiler.compile`.
            ImportError: llguidance is not installed.
        """
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.engine.target.config.vocab_size)
        return self._grammars.compile(spec)

    def generate(self, inputs: Prompt | Sequence[Prompt], *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, stream: bool = False, speculative: bool = True,
                 method: str | None = None):
        """Generates for one prompt or a batch (text, token ids, or chat messages).  ``method``: the
        drafter (``"dart"``, or ``"eagle3"`` where an ``eagle3_head`` is loaded beside it); None: the
        model's default.

        Raises:
            ValueError: a method the model does not hold (as :meth:`DartEngine.generate_stream`).

        Returns:
            a :class:`GenerateOutput` (list of :class:`Completion`), or with
            ``stream=True`` an iterator of :class:`StreamChunk`.
        """
        prompts = self._batch(inputs)
        sampling = self.sampling_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=seed, stop_token_ids=stop_token_ids)
        if stream:
            return self._stream(prompts, sampling, speculative, method)
        result = self.engine.generate(prompts, sampling, speculative=speculative, method=method)
        return GenerateOutput([Completion(ids, self.tokenizer.decode(ids, skip_special_tokens=True), reason)
                               for ids, reason in zip(result.token_ids, result.finish_reasons)], result)

    def _stream(self, prompts, sampling, speculative, method) -> Iterator[StreamChunk]:
        detoks = [IncrementalDetokenizer(self.tokenizer) for _ in prompts]
        for step in self.engine.generate_stream(prompts, sampling, speculative=speculative, method=method):
            for sid, toks, reason in zip(step.seq_ids, step.new_tokens, step.finish_reasons):
                delta = detoks[sid].add(toks)
                if reason is not None:
                    delta += detoks[sid].finish()
                yield StreamChunk(sid, list(toks), delta, reason)
