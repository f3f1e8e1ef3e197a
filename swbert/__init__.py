"""swbert: BERT-style encoders whose self-attention shares one weight matrix for Q, K and V."""

# The public names, re-exported explicitly (`X as X`); swbert.models lists the rest of the model API.
from swbert.models import (
    SIZES as SIZES,
    SWBertConfig as SWBertConfig,
    SWBertForMaskedLM as SWBertForMaskedLM,
    SWBertForQuestionAnswering as SWBertForQuestionAnswering,
    SWBertForSequenceClassification as SWBertForSequenceClassification,
    SWBertModel as SWBertModel,
)

__version__ = "0.1.0"
