"""The BERT encoder and its heads, with the attention variant taken from the config.

Post-LayerNorm blocks as in BERT, so that the `standard` variant is numerically the same model as
`transformers.BertModel`. Pure PyTorch: parallelism is applied from outside (swbert.parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)

from swbert.models.attention import Mask, Rows, SelfAttention, build_attention
from swbert.models.config import SWBertConfig
from swbert.models.hf_weights import register_hf_weight_conversions
from swbert.models.mlm_loss import MLM_CHUNK_BYTES, logit_stats
from swbert.models.positions import Rotary, RotaryEmbedding, local_attention_mask
from swbert.models.varlen import SeqLens, pad_by_seqlens

IGNORE_INDEX = -100

# An attribute of the word embedding and the MLM decoder when their tables are padded
# (config.pad_vocab_multiple): the number of real rows; the rows after them are padding.
VOCAB_ROWS = "vocab_rows"


def _pad_vocab(module: nn.Embedding | nn.Linear, config: SWBertConfig) -> nn.Module:
    """`module`, built with vocab_size rows, with zero rows appended up to config.padded_vocab_size.

    Built at the tokenizer's size first, so construction draws from the random stream exactly what an
    unpadded table would (with `_normal_rows_`: the same seed gives the same weights, padded or not)."""
    rows = config.padded_vocab_size
    if rows == config.vocab_size:
        return module
    with torch.no_grad():
        for name in ("weight", "bias"):
            t = getattr(module, name, None)
            if t is not None:
                pad = t.new_zeros(rows - t.shape[0], *t.shape[1:])
                setattr(module, name, nn.Parameter(torch.cat([t, pad]), requires_grad=t.requires_grad))
    if isinstance(module, nn.Embedding):
        module.num_embeddings = rows
    else:
        module.out_features = rows
    setattr(module, VOCAB_ROWS, config.vocab_size)
    return module


class Embeddings(nn.Module):
    """Word + learned position + token type embeddings, then LayerNorm and dropout. With rotary
    positions (config.position_embedding "rope") there is no position table: the attention layers
    rotate their queries and keys instead (swbert.models.positions)."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        d = config.hidden_size
        # config.padded_vocab_size rows: the ones past vocab_size are never looked up
        word = nn.Embedding(config.vocab_size, d, padding_idx=config.pad_token_id)
        self.word_embeddings = _pad_vocab(word, config)
        learned = config.position_embedding == "learned"
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, d) if learned else None
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, d)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # (B, S, d)
        x = inputs_embeds
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(self._position_ids(position_ids, x))
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]  # every token in segment 0
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))

    def _position_ids(self, position_ids: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """The given ids, or 0..S-1 when the sequence fits the learned table (an error otherwise)."""
        if position_ids is not None:
            return position_ids
        S, rows = x.shape[1], self.position_embeddings.num_embeddings
        if S > rows:
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings={rows}")
        return torch.arange(S, device=x.device)[None]  # (1, S)


class MLP(nn.Module):
    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """One post-LN encoder layer: attention then MLP, each wrapped in residual + LayerNorm."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.attn = build_attention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self, x: torch.Tensor, mask: Mask = None, rows: Rows | None = None, rotary: Rotary | None = None
    ) -> torch.Tensor:
        """(B, S, d) -> (B, S, d); with `rows` (batch and position indices) only those positions,
        (N, d). Every position still serves as a key and a value; what is saved is the output
        projection, residual, LayerNorms and MLP on the positions not kept. `rotary`: the (cos, sin)
        of rotary positions (swbert.models.positions), None with learned ones."""
        # learned positions call the attention as before, so a forward written for (x, mask, rows) runs
        a = self.attn(x, mask, rows) if rotary is None else self.attn(x, mask, rows, rotary)
        if rows is not None:
            x = x[rows]  # (N, d)
        x = self.attn_norm(x + self.dropout(a))
        x = self.mlp_norm(x + self.dropout(self.mlp(x)))
        return x


class Encoder(nn.Module):
    """The blocks in order. Activation checkpointing is applied per block from outside
    (`swbert.training.wrappers`), as every other wrapper is. With local attention
    (config.local_attention_window) the layers that `config.attention_window` makes local read
    the local mask, the others the global one."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.local_layers = [config.attention_window(i) is not None for i in range(config.num_hidden_layers)]

    def forward(
        self,
        x: torch.Tensor,
        mask: Mask = None,
        output_hidden_states: bool = False,
        output_rows: torch.Tensor | Rows | None = None,
        rotary: Rotary | None = None,
        local_mask: Mask = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """`output_rows`: the last layer computes only those positions (see `Block`), given as a
        (B, S) bool mask or as (batch indices, positions); indices cost no device-to-host sync.
        `rotary`: every layer's (cos, sin); `local_mask`: the local layers' mask (`SWBertModel`)."""
        hidden_states = (x,) if output_hidden_states else None
        kept = output_rows
        if isinstance(output_rows, torch.Tensor):  # a mask: its indices, found once (one host sync)
            kept = output_rows.nonzero(as_tuple=True)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = kept if i == last else None
            x = layer(x, local_mask if self.local_layers[i] else mask, rows, rotary)
            if output_hidden_states:
                hidden_states = hidden_states + (x,)
        return x, hidden_states


class Pooler(nn.Module):
    """tanh(W h_[CLS] + b), as BERT."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, h: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """h: (B, S, d), [CLS] at position 0; or an unpadded stream (T, d) with each sequence's
        first index in `starts` (B,)."""
        cls = h[:, 0] if starts is None else h[starts]  # (B, d)
        return torch.tanh(self.dense(cls))


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S) 1/0 mask -> (B, 1, 1, S) bool for the kernel. None keeps the unmasked fast path.

    A mask given is used as it is: asking whether it pads anything would cost a host sync in every
    step. Callers that know a batch holds no padding pass none (packed pretraining batches, and
    `swbert.finetune.glue_data.pad_collate` for a batch of equal lengths), so the fused GPU kernels
    keep flash attention there.
    """
    if attention_mask is None:
        return None
    return attention_mask.bool()[:, None, None, :]


class SWBertPreTrainedModel(PreTrainedModel):
    config_class = SWBertConfig
    base_model_prefix = "bert"
    _no_split_modules = ["Block"]

    def __init__(self, config: SWBertConfig, *inputs: object, **kwargs: object) -> None:
        # save_pretrained / from_pretrained keep the attention projections separate in the folder's
        # files: the conversions of every variant registered by now (a plugin's too), in place
        # before transformers reads them to load or save this model
        register_hf_weight_conversions()
        super().__init__(config, *inputs, **kwargs)

    def optimize_for_inference(self) -> SWBertPreTrainedModel:
        """Fold parameters that training keeps apart into a cheaper equivalent; returns self in eval mode.

        For `shared`, dq*dk becomes one vector on the query side and dv moves into the output
        projection (`SharedAttention.fold_for_inference`); the other variants have nothing to fold.
        Eval outputs are unchanged up to float rounding. Fold after loading weights, not before
        training: a folded shared layer leaves dk and dv unused. With rotary positions nothing is
        folded: the rotation does not commute with moving dk to the queries (`SelfAttention.forward`).
        """
        if self.config.position_embedding == "rope":
            return self.eval()
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.fold_for_inference()
        return self.eval()

    def trim_vocab_padding(self) -> SWBertPreTrainedModel:
        """Drop the padded rows of the word embedding and the tied MLM decoder (config.pad_vocab_multiple),
        in place; returns self. The model computes the same function (padded ids are never inputs, their
        logits are cut): exports do this, so a folder's tables match the tokenizer's vocabulary."""
        config = self.config
        rows = config.vocab_size
        embedding = self.get_input_embeddings()
        if embedding.num_embeddings != rows:
            w = embedding.weight
            trimmed = nn.Embedding(rows, w.shape[1], embedding.padding_idx, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                trimmed.weight.copy_(w[:rows])
            self.set_input_embeddings(trimmed)
        decoder = self.get_output_embeddings()
        if decoder is not None and decoder.out_features != rows:
            has_bias = decoder.bias is not None
            new = nn.Linear(
                decoder.in_features, rows, has_bias, device=decoder.weight.device, dtype=decoder.weight.dtype
            )
            if has_bias:
                with torch.no_grad():
                    new.bias.copy_(decoder.bias[:rows])
            self.set_output_embeddings(new)
            self.tie_weights()  # the decoder's weight is the (trimmed) word embedding again
        config.pad_vocab_multiple = 1
        return self

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            _normal_rows_(module.weight, getattr(module, VOCAB_ROWS, None), std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            _normal_rows_(module.weight, getattr(module, VOCAB_ROWS, None), std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, SelfAttention):
            module.init_parameters()  # each variant knows its own (dq, dk, dv at ones; U the identity)


def _normal_rows_(weight: torch.Tensor, rows: int | None, std: float) -> None:
    """N(0, std) in the first `rows` rows (all when None), zeros in the padded ones after them.

    Drawing the real rows only keeps the random stream an unpadded table would use, so a model with a
    padded vocabulary starts from the same weights as one without (same seed)."""
    if rows is None:
        weight.normal_(0.0, std)
        return
    weight[:rows].normal_(0.0, std)  # (rows, d): a contiguous view, drawn as an unpadded table would be
    weight[rows:].zero_()


class SWBertModel(SWBertPreTrainedModel):
    """The bare encoder: embeddings, blocks and (optionally) BERT's pooler."""

    def __init__(self, config: SWBertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        rope = config.position_embedding == "rope"
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta) if rope else None
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        output_rows: torch.Tensor | Rows | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        **_: object,
    ) -> BaseModelOutputWithPooling:
        """`output_rows`: a (B, S) bool mask, or (batch indices, positions) index tensors; the last
        layer then computes only those positions and `last_hidden_state` is (N, d), in row-major
        order of the True entries or in the order of the indices (what `hidden[output_rows]` of the
        full output would be). Not with the pooler or `output_hidden_states`, which need every
        position of the last layer.

        Unpadded (`cu_seqlens` (B+1,) int32 and `max_seqlen`, see swbert.models.varlen): the inputs
        are one stream of T tokens, (T,) or (1, T); no attention_mask; positions restart in each
        sequence unless given; `last_hidden_state` is (T, d) and the pooler reads each first token."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if output_rows is not None and (self.pooler is not None or output_hidden_states):
            raise ValueError("output_rows leaves out positions the pooler or output_hidden_states need")
        seqlens = None
        if cu_seqlens is not None:
            seqlens = self._seqlens(cu_seqlens, max_seqlen, attention_mask)
            input_ids, token_type_ids, position_ids, inputs_embeds = _as_stream(
                seqlens, input_ids, token_type_ids, position_ids, inputs_embeds
            )
        shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]  # (B, S) or (1, T)
        x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)  # (B, S, d) or (1, T, d)
        mask = seqlens if seqlens is not None else key_padding_mask(attention_mask)
        rotary, local_mask = self._position_inputs(shape, position_ids, mask, x.device)
        x, hidden_states = self.encoder(x, mask, output_hidden_states, output_rows, rotary, local_mask)
        if seqlens is not None and output_rows is None:
            x = x[0]  # (T, d)
        starts = None if seqlens is None else seqlens.starts()
        pooled = self.pooler(x, starts) if self.pooler is not None else None
        return BaseModelOutputWithPooling(
            last_hidden_state=x, pooler_output=pooled, hidden_states=hidden_states
        )

    def _position_inputs(
        self, shape: tuple[int, ...], position_ids: torch.Tensor | None, mask: Mask, device: torch.device
    ) -> tuple[Rotary | None, Mask]:
        """The encoder's rotary (cos, sin) and the local layers' mask, made once for every layer from
        the whole sequence (before sequence parallelism splits the activations): None where off."""
        rotary = local_mask = None
        if self.rotary is not None:
            if position_ids is None:  # a padded batch: 0..S-1 (an unpadded stream's restart per sequence)
                position_ids = torch.arange(shape[1], device=device)[None]  # (1, S)
            rotary = self.rotary(position_ids)  # (B or 1, 1, S, Dh) each
        if any(self.encoder.local_layers):  # one band for every local layer: half the window each side
            local_mask = local_attention_mask(mask, shape[1], self.config.local_attention_window // 2, device)
        return rotary, local_mask

    def _seqlens(
        self, cu_seqlens: torch.Tensor, max_seqlen: int | None, attention_mask: torch.Tensor | None
    ) -> SeqLens:
        """The stream's boundaries, checked against the learned positions (errors name the sequence)."""
        if attention_mask is not None:
            raise ValueError(
                "pass cu_seqlens (an unpadded stream) or attention_mask (a padded batch), not both"
            )
        if max_seqlen is None:
            raise ValueError("cu_seqlens needs max_seqlen, the longest sequence's length")
        seqlens = SeqLens(cu_seqlens, max_seqlen)
        if self.config.position_embedding == "learned":  # rotary positions have no table to run past
            seqlens.check_positions(self.config.max_position_embeddings)
        return seqlens


def _as_stream(seqlens: SeqLens, *inputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Per-token inputs of an unpadded stream as a batch of one, (1, T) or (1, T, d): the encoder,
    the variants' `qkv` and head split run on it unchanged. Positions restart in each sequence."""
    input_ids, token_type_ids, position_ids, inputs_embeds = (
        t if t is None or t.ndim == (3 if i == 3 else 2) else t[None] for i, t in enumerate(inputs)
    )
    if position_ids is None:
        total = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        position_ids = seqlens.position_ids(total)[None]  # (1, T)
    return input_ids, token_type_ids, position_ids, inputs_embeds


class MLMHead(nn.Module):
    """Transform (dense, GELU, LayerNorm) then the decoder, whose weight is the word embedding.

    Given the rows' `target` (N,), it returns the loss and each row's predicted id instead of the
    logits, computed in vocabulary chunks (`swbert.models.mlm_loss`, ours): the loss is inside the
    head's forward, so compiling the head compiles it too. A decoder with its own
    `chunked_mlm_loss` (the vocab-parallel one) computes it."""

    chunk_bytes = MLM_CHUNK_BYTES  # the fp32 logits of one vocabulary chunk at most

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        # padded like the word embedding it is tied to; SWBertForMaskedLM cuts the logits at vocab_size
        self.decoder = _pad_vocab(nn.Linear(config.hidden_size, config.vocab_size), config)
        self.vocab_size = config.vocab_size

    def forward(
        self, h: torch.Tensor, target: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(..., padded_vocab_size) logits; with `target` (N,) for h (N, d): (loss, predicted ids (N,))."""
        x = self.norm(self.act(self.dense(h)))
        if target is None:
            return self.decoder(x)
        # a bad id would silently count as a wrong prediction: an asynchronous device check, no sync
        valid = (target == IGNORE_INDEX) | ((target >= 0) & (target < self.vocab_size))
        torch._assert_async(valid.all(), "MLM targets must be token ids below vocab_size or IGNORE_INDEX")
        own = getattr(self.decoder, "chunked_mlm_loss", None)
        if own is not None:
            return own(x, target, self.vocab_size, self.chunk_bytes)
        d = self.decoder
        lse, picked, _, predicted = logit_stats(
            x, d.weight, d.bias, target, self.vocab_size, self.chunk_bytes
        )
        return mlm_loss_from_stats(lse, picked, target), predicted


@dataclass
class SWBertMaskedLMOutput(MaskedLMOutput):
    """`MaskedLMOutput` with `predictions`, the predicted id of each predicted row (N,), given
    instead of `logits` when the model is called with `return_logits=False`."""

    predictions: torch.Tensor | None = None


class SWBertForMaskedLM(SWBertPreTrainedModel):
    """Masked-LM pretraining model with tied input/output embeddings, on one path.

    The predicted rows come from `labels` (B, S) (the labelled positions) or, for static shapes,
    from `mlm_positions` (B, P) with `mlm_targets` (B, P): a fixed number P per sequence, padded with
    IGNORE_INDEX targets, so every shape depends on (B, S, P) only (no graph break, no device-to-host
    sync). The loss is the mean cross entropy over the labelled rows (`logits_and_loss`).

    `masked_logits_only` (default: in training, or given positions) runs the head on the predicted
    rows only, `logits` (N, vocab) in row-major order of the rows (B * P with positions, padding
    included): vocabulary-wide logits for every token would waste ~20% of BERT-base's FLOPs.
    Otherwise `logits` are (B, S, vocab) like `BertForMaskedLM`'s, which pipelines and
    `transformers.Trainer` expect, with the same loss. (Its name avoids "label": Trainer takes such
    arguments for labels.)

    With the head on the rows only, the last layer computes only those rows too (`SWBertModel`'s
    `output_rows`): its output projection, LayerNorms and MLP on 15% of the tokens, ~5% of
    BERT-base's training FLOPs. `last_layer_on_labels = False` computes every position and selects
    after (sequence parallelism needs that).
    """

    last_layer_on_labels = True  # parallelize() turns it off under sequence parallelism

    _tied_weights_keys = {"mlm_head.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        self.bert = SWBertModel(config, add_pooling_layer=False)
        self.mlm_head = MLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.mlm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.mlm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        masked_logits_only: bool | None = None,
        mlm_positions: torch.Tensor | None = None,
        mlm_targets: torch.Tensor | None = None,  # not "labels": transformers' Trainer takes those for labels
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        return_logits: bool = True,
        **_: object,
    ) -> SWBertMaskedLMOutput:
        """`cu_seqlens` and `max_seqlen` (over the B x S tokens of a packed batch, which has no
        padding): attention stays within each of those sequences (a packed sample's documents,
        `swbert.data.packing.document_seqlens`), positions restart in each; rows and logits keep
        their (B, S) meaning.

        `return_logits=False` with the head on the predicted rows (training, or given positions)
        and targets: no logits; the loss and each row's predicted id (`predictions`, (N,)) come from
        the head's chunked cross entropy, which never holds (N, vocab) logits (ours; the trainer's
        path)."""
        rows, target = _predicted_rows(labels, mlm_positions, mlm_targets)
        if masked_logits_only is None:  # the head on the predicted rows when training or given positions
            masked_logits_only = self.training or mlm_positions is not None
        full = rows is None or not masked_logits_only  # (B, S, vocab) logits: transformers' convention
        prune = not full and self.last_layer_on_labels and not output_hidden_states
        shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]  # (B, S)
        stream = _PackedStream(shape, cu_seqlens)
        out = self.bert(
            *stream.flat(input_ids, token_type_ids, position_ids, inputs_embeds, attention_mask),
            output_hidden_states=output_hidden_states,
            output_rows=stream.rows(rows) if prune else None,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        h = out.last_hidden_state  # (B, S, d), or (N, d) when the last layer computed the rows only
        if cu_seqlens is not None and not prune:
            h = h.view(*shape, -1)
        if full:
            logits, _ = self.logits_and_loss(h, None)  # (B, S, vocab)
            loss = None if rows is None else self.loss_on(logits[rows], target)
        elif not return_logits and target is not None:
            loss, predicted = self.mlm_head(h if prune else h[rows], target)
            return SWBertMaskedLMOutput(loss=loss, hidden_states=out.hidden_states, predictions=predicted)
        else:
            logits, loss = self.logits_and_loss(h if prune else h[rows], target)
        return SWBertMaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)

    def logits_and_loss(
        self, h: torch.Tensor, target: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head on h, (B, S, d) or (N, d) at the predicted positions, and the mean cross entropy
        over the rows whose `target` (N,) is a label (IGNORE_INDEX rows, a static batch's padding,
        left out on the device: no host sync). Tensor parallelism overrides this.

        Logits end at vocab_size: the padded rows of the decoder (config.pad_vocab_multiple) are
        never predicted, and the loss is the one of the same model without them."""
        logits = self.mlm_head(h)  # (..., padded_vocab_size)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        return logits, None if target is None else self.loss_on(logits, target)

    @staticmethod
    def loss_on(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of (N, vocab) logits over the rows whose target is a label."""
        return labelled_mean(F.cross_entropy(logits.float(), target, reduction="none"), target)


class _PackedStream:
    """A packed batch (B, S) as the one token stream of `cu_seqlens` (document attention), or as it
    is when there are none: its inputs flattened to (1, B x S), its predicted rows moved there."""

    def __init__(self, shape: tuple[int, ...], cu_seqlens: torch.Tensor | None) -> None:
        self.seq_len = shape[1]
        self.on = cu_seqlens is not None

    def flat(self, input_ids, token_type_ids, position_ids, inputs_embeds, attention_mask) -> tuple:
        """SWBertModel's first arguments: (input_ids, attention_mask, token_type_ids, position_ids,
        inputs_embeds)."""
        if not self.on:
            return input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if attention_mask is not None:
            raise ValueError("a packed batch with cu_seqlens has no padding: pass no attention_mask")

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.reshape(1, -1, *t.shape[2:])

        return flat(input_ids), None, flat(token_type_ids), flat(position_ids), flat(inputs_embeds)

    def rows(self, rows: Rows | None) -> Rows | None:
        if not self.on or rows is None:
            return rows
        batch_index, positions = rows
        return torch.zeros_like(batch_index), batch_index * self.seq_len + positions


def _predicted_rows(
    labels: torch.Tensor | None, positions: torch.Tensor | None, targets: torch.Tensor | None
) -> tuple[Rows | None, torch.Tensor | None]:
    """The one place the predicted rows are chosen: (batch indices, positions) and their targets.
    From `labels` (B, S): the labelled positions (N of them, row-major). From static `positions`
    (B, P) and `targets` (B, P): every given position, padding included (its target IGNORE_INDEX),
    so the shapes depend on (B, P) only: no device-to-host sync, no graph break."""
    if positions is not None:
        B, P = positions.shape
        batch_index = torch.arange(B, device=positions.device).repeat_interleave(P)  # (B * P,)
        return (batch_index, positions.reshape(-1)), None if targets is None else targets.reshape(-1)
    if labels is None:
        return None, None
    rows = (labels != IGNORE_INDEX).nonzero(as_tuple=True)  # what boolean indexing computes
    return rows, labels[rows]


def labelled_mean(losses: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of per-row `losses` over the rows whose target is a label (the ignored rows hold 0);
    with no labelled row it is a zero that keeps the graph."""
    count = (target != IGNORE_INDEX).sum().clamp(min=1)
    return losses.sum() / count


def mlm_loss_from_stats(lse: torch.Tensor, picked: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy `lse - target logit` over the labelled rows, from `logit_stats`'s (N,)."""
    return labelled_mean(torch.where(target != IGNORE_INDEX, lse - picked, 0.0), target)


def _classification_loss(config: SWBertConfig, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Transformers' `problem_type` rules: regression for one label, else single/multi-label."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.float().view(-1, config.num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


class SWBertForSequenceClassification(SWBertPreTrainedModel):
    """Pooled [CLS] -> dropout -> linear; classification or regression (num_labels == 1, STS-B)."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = SWBertModel(config)
        p = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        **_: object,
    ) -> SequenceClassifierOutput:
        """Padded (B, S) inputs, or an unpadded stream with `cu_seqlens` and `max_seqlen` (see
        `SWBertModel`): the pooler reads each sequence's [CLS] either way, so the logits are (B, n)."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_hidden_states,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        logits = self.classifier(self.dropout(out.pooler_output))  # (B, num_labels)
        loss = _classification_loss(self.config, logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


class SWBertForQuestionAnswering(SWBertPreTrainedModel):
    """Extractive QA: start and end logits over the tokens (SQuAD)."""

    def __init__(self, config: SWBertConfig) -> None:
        super().__init__(config)
        self.bert = SWBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        **_: object,
    ) -> QuestionAnsweringModelOutput:
        """Padded (B, S) inputs, or an unpadded stream with `cu_seqlens` and `max_seqlen`, whose
        logits come back padded to (B, max_seqlen) so that span decoding is the same. Padding gets the
        lowest logit in both: the loss is a softmax over each sequence's real tokens (with the padding
        in it, as in transformers, the loss would depend on how far its batch was padded)."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids,
            inputs_embeds,
            output_hidden_states,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        logits = self.qa_outputs(out.last_hidden_state)  # (B, S, 2), or (T, 2) unpadded
        lowest = torch.finfo(logits.dtype).min
        if cu_seqlens is not None:
            logits = pad_by_seqlens(logits, SeqLens(cu_seqlens, max_seqlen), fill=lowest)  # (B, S, 2)
        elif attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool()[..., None], lowest)
        start_logits, end_logits = logits.unbind(dim=-1)  # (B, S) each
        loss = None
        if start_positions is not None and end_positions is not None:
            S = start_logits.shape[1]
            # positions outside the window (answer cut off) are ignored, as in transformers
            start = start_positions.view(-1).clamp(0, S)
            end = end_positions.view(-1).clamp(0, S)
            loss = (
                F.cross_entropy(start_logits.float(), start, ignore_index=S)
                + F.cross_entropy(end_logits.float(), end, ignore_index=S)
            ) / 2
        return QuestionAnsweringModelOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits, hidden_states=out.hidden_states
        )
