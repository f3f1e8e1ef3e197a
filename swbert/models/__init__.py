"""Models: config, attention variants, encoder and heads. Registered with the transformers Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
)

from swbert.models.attention import (
    ATTENTION_CLASSES,
    SelfAttention,
    attention_class,
    attention_types,
    build_attention,
    register_attention,
    unregister_attention,
)
from swbert.models.config import SIZES, SWBertConfig
from swbert.models.modeling import (
    SWBertForMaskedLM,
    SWBertForQuestionAnswering,
    SWBertForSequenceClassification,
    SWBertModel,
    SWBertPreTrainedModel,
)

AutoConfig.register(SWBertConfig.model_type, SWBertConfig, exist_ok=True)
AutoModel.register(SWBertConfig, SWBertModel, exist_ok=True)
AutoModelForMaskedLM.register(SWBertConfig, SWBertForMaskedLM, exist_ok=True)
AutoModelForSequenceClassification.register(SWBertConfig, SWBertForSequenceClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(SWBertConfig, SWBertForQuestionAnswering, exist_ok=True)

__all__ = [
    "ATTENTION_CLASSES",
    "SIZES",
    "SWBertConfig",
    "SWBertForMaskedLM",
    "SWBertForQuestionAnswering",
    "SWBertForSequenceClassification",
    "SWBertModel",
    "SWBertPreTrainedModel",
    "SelfAttention",
    "attention_class",
    "attention_types",
    "build_attention",
    "register_attention",
    "unregister_attention",
]
