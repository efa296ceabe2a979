"""Built-in ``text`` workload: a Transformer encoder tagging tokens of variable-length sequences.

It is the case for dynamic batching: sequence lengths are long-tailed (lognormal, median 32 tokens,
a tail capped at 512), so padding each batch to its longest sample wastes most of the compute. The
collate function is the naive one (pad to the batch maximum); bucketing is the data module's job.

Task: per-token tagging, ``label_t = (tok_t + tok_{t-1} mod 2) mod num_classes`` with
``tok_{-1} = 0``, over Zipf-distributed token ids (as in real text). The token alone narrows the
label to two classes, so the loss falls from ln(num_classes) towards ln 2 within a few dozen
steps; resolving the pair needs the previous token, i.e. attention plus positions, which the
default recipe learns after some 300-500 steps. Dropout 0.1 is present, so activation
checkpointing must replay the same dropout masks.

Sizes are aligned on purpose (vocab 1024 and d_model 128: multiples of 64). The loss is the mean
over real tokens and the count is the number of real tokens, so accumulation over batches with
different token counts can be exact.

Measured default step (batch 16, forward + backward + AdamW, fp32 eager, 2 threads) on the 2-core
AVX-512 CPU, torch 2.13.0: median 105-127 ms over two runs, from 60 ms to 660 ms with the batch's
longest sample; two thirds of the padded tokens are padding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from torchturbo.data.collate import IGNORE_INDEX, pad_collate
from torchturbo.recipe import Recipe

VOCAB_SIZE = 1024
MAX_LEN = 512
DEFAULT_BATCH_SIZE = 16
_MEDIAN_LEN = 32
_LOG_LEN_STD = 0.8  # p90/median = e^(1.28 * 0.8) ~ 2.8; a few samples in 4096 reach the cap
_MIN_LEN = 4
_ZIPF_OFFSET = 2.7  # Zipf-Mandelbrot: p(rank k) ~ 1 / (k + 2.7); the top 10 ids carry 28 %
PAD_ID = 0  # pad_collate's default; real tokens are drawn from 1..VOCAB_SIZE-1


class TokenTagger(nn.Module):
    """Token + learned position embeddings, ``nn.TransformerEncoder`` (pre-norm), linear tagger."""

    def __init__(
        self,
        num_classes: int,
        d_model: int,
        num_layers: int,
        num_heads: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = nn.Embedding(MAX_LEN, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=4 * d_model,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # Nested tensors only help inference and warn with norm_first=True; training needs none.
        self.encoder = nn.TransformerEncoder(
            layer, num_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens_BT = batch["tokens"]
        positions = torch.arange(tokens_BT.shape[1], device=tokens_BT.device)
        x_BTD = self.embed(tokens_BT) + self.pos(positions)
        x_BTD = self.encoder(x_BTD, src_key_padding_mask=~batch["mask"])
        return self.head(x_BTD)


class TokenSequences(Dataset):
    """Sequences stored back to back in flat tensors; items are
    ``{"tokens": LongTensor[L], "labels": LongTensor[L]}``."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor) -> None:
        self.tokens = tokens
        self.labels = labels
        self.lengths = lengths.tolist()
        self.starts = (torch.cumsum(lengths, 0) - lengths).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, length = self.starts[index], self.lengths[index]
        return {
            "tokens": self.tokens[start : start + length],
            "labels": self.labels[start : start + length],
        }


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy averaged over real tokens, and the number of real tokens.

    The count stays a tensor: turning it into an int would synchronise with the device each step.
    """
    logits_BTC = model(batch)
    labels_BT = batch["labels"]
    loss = F.cross_entropy(logits_BTC.flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE_INDEX)
    return loss, (labels_BT != IGNORE_INDEX).sum()


def make_sequences(
    num_samples: int, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat tokens and labels of all sequences, and their long-tailed lengths; fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    log_len = torch.empty(num_samples).normal_(0.0, _LOG_LEN_STD, generator=gen)
    lengths = (_MEDIAN_LEN * log_len.exp()).round().clamp(_MIN_LEN, MAX_LEN).long()
    # Zipf-like token frequencies, as in real text; which ids are frequent is random.
    frequency = 1.0 / (torch.arange(VOCAB_SIZE - 1) + _ZIPF_OFFSET)
    token_of_rank = torch.randperm(VOCAB_SIZE - 1, generator=gen) + 1
    ranks = torch.multinomial(frequency, int(lengths.sum()), replacement=True, generator=gen)
    tokens = token_of_rank[ranks]
    previous = torch.roll(tokens, 1)
    starts = torch.cumsum(lengths, 0) - lengths
    previous[starts] = 0  # no token before a sequence's first
    labels = (tokens + previous % 2) % num_classes
    return tokens, labels, lengths


def text(
    *,
    seed: int = 0,
    batch_size: int | None = None,
    num_samples: int = 4096,
    num_classes: int = 16,
    d_model: int = 128,
    num_layers: int = 2,
    dropout: float = 0.1,
    lr: float = 5e-3,
) -> Recipe:
    """Transformer encoder token tagger on long-tailed sequences (see the module docstring).

    ``d_model`` must be a positive multiple of 64; ``lr`` is the AdamW learning rate.
    """
    if d_model < 64 or d_model % 64:
        raise ValueError(f"text: d_model must be a positive multiple of 64, got {d_model!r}")
    if not 2 <= num_classes <= VOCAB_SIZE:
        raise ValueError(f"text: num_classes must be in [2, {VOCAB_SIZE}], got {num_classes!r}")
    if num_samples < 1:
        raise ValueError(f"text: num_samples must be >= 1, got {num_samples!r}")
    if num_layers < 1:
        raise ValueError(f"text: num_layers must be >= 1, got {num_layers!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"text: dropout must be in [0, 1), got {dropout!r}")
    tokens, labels, lengths = make_sequences(num_samples, num_classes, seed)
    return Recipe(
        name="text",
        model=functools.partial(TokenTagger, num_classes, d_model, num_layers, dropout=dropout),
        optimizer=functools.partial(torch.optim.AdamW, lr=lr),
        loss_fn=loss_fn,
        dataset=TokenSequences(tokens, labels, lengths),
        batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
        collate=functools.partial(pad_collate, pad_id=PAD_ID, pad_to_multiple=1),
        lengths=lengths.tolist(),
        count_unit="tokens",
        seed=seed,
        extras={
            "vocab_size": VOCAB_SIZE,
            "max_len": MAX_LEN,
            "num_classes": num_classes,
            "d_model": d_model,
        },
    )
