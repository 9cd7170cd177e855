"""``vllm_omni.general_plugins`` entry point: a single-stage LLM_AR pipeline and the model registrations."""

from __future__ import annotations

from kvx_omni_testplugin.tiny_model import ARCHITECTURE, PIPELINE_MODEL_TYPE

MODEL_CLS = "kvx_omni_testplugin.model:KvxTinyQwen2ForCausalLM"
_registered = False


def _pipeline() -> object:
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    # The checkpoint reports model_type "qwen2", which no vllm-omni pipeline owns; the factory then matches
    # hf_config.architectures against hf_architectures (the route MiMo-Audio uses for the same reason).
    return PipelineConfig(
        model_type=PIPELINE_MODEL_TYPE,
        model_arch=ARCHITECTURE,
        hf_architectures=(ARCHITECTURE,),
        stages=(
            StagePipelineConfig(
                stage_id=0,
                model_stage="thinker",
                execution_type=StageExecutionType.LLM_AR,
                input_sources=(),
                final_output=True,
                final_output_type="text",
                owns_tokenizer=True,
                engine_output_type="text",
                sampling_constraints={"detokenize": True},
            ),
        ),
    )


def register() -> None:
    """Idempotent: vllm-omni loads general plugins once per process, in several processes."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm_omni.config.pipeline_registry import register_pipeline
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    register_pipeline(_pipeline())  # type: ignore[arg-type]
    # vLLM's registry validates the architecture; vllm-omni's OmniModelConfig loads from its own registry.
    for registry in (ModelRegistry, OmniModelRegistry):
        if ARCHITECTURE not in registry.get_supported_archs():
            registry.register_model(ARCHITECTURE, MODEL_CLS)
    _registered = True
