"""Recipes with a bug in the user's code or data, one per function, as a new user writes them.

Each is a small learnable classifier until the one thing it gets wrong. tests/test_cli_errors.py
runs them through the CLI: each must end in one line naming what failed, with exit code 2.
"""

import dataclasses

import torch
from torch import nn

from torchturbo import Recipe


def _recipe(**changes):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(32, 4, generator=generator)
    labels = (inputs[:, 0] > 0).long()
    fields = {
        "name": "broken",
        "model": lambda: nn.Linear(4, 2),
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
        "loss_fn": lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        "dataset": torch.utils.data.TensorDataset(inputs, labels),
        "batch_size": 8,
    }
    return Recipe(**{**fields, **changes})


def raises():
    raise RuntimeError("recipe exploded")


def model_raises():
    def make_model():
        raise RuntimeError("no weights here")

    return _recipe(model=make_model)


def model_not_a_module():
    return _recipe(model=lambda: "a model")


def optimizer_raises():
    return _recipe(optimizer=lambda params: torch.optim.SGD(params, lr=-1.0))


def optimizer_not_an_optimizer():
    return _recipe(optimizer=lambda params: list(params))


def missing_key():
    samples = [{"x": torch.randn(4), "y": 1} for _ in range(16)]
    samples[3] = {"x": torch.randn(4)}
    loss = lambda model, batch: nn.functional.cross_entropy(model(batch["x"]), batch["y"])  # noqa: E731
    return _recipe(dataset=samples, loss_fn=loss)


def none_in_samples():
    return _recipe(dataset=[(torch.randn(4), None) for _ in range(16)])


def none_in_samples_torch_collate():
    dataset = [(torch.randn(4), None) for _ in range(16)]
    return _recipe(dataset=dataset, collate=torch.utils.data.default_collate)


def strings_in_samples():
    return _recipe(dataset=[(torch.randn(4), "cat") for _ in range(16)])


def loss_count_is_a_string():
    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1]), "eight"

    return _recipe(loss_fn=loss_fn)


def model_shape_mismatch():
    return _recipe(model=lambda: nn.Linear(5, 2))


class FlakyDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 5:
            raise OSError("sample 5 is on a disk that went away")
        return torch.randn(4), 0


def dataset_raises():
    return _recipe(dataset=FlakyDataset())


def collate_raises():
    def collate(samples):
        raise ValueError(f"cannot collate {len(samples)} samples")

    return _recipe(collate=collate)


def empty_dataset():
    return _recipe(dataset=torch.utils.data.TensorDataset(torch.zeros(0, 4), torch.zeros(0)))


def nan_inputs():
    inputs = torch.full((32, 4), float("nan"))
    return _recipe(dataset=torch.utils.data.TensorDataset(inputs, torch.zeros(32).long()))


def infinite_learning_rate():
    return _recipe(optimizer=lambda params: torch.optim.SGD(params, lr=float("inf")))


def wider():
    """Another architecture than :func:`sgd`: resuming one's checkpoint with the other fails."""
    return _recipe(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))


def sgd():
    return _recipe(model=lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)))


def adam():
    """:func:`sgd`'s model with Adam: its checkpoint cannot be resumed with SGD."""
    return dataclasses.replace(sgd(), optimizer=lambda params: torch.optim.Adam(params, lr=0.01))


def empty_texts():
    """A text dataset whose samples all tokenized to nothing (a wrong text column)."""
    samples = [{"input_ids": torch.zeros(0, dtype=torch.long), "y": i % 2} for i in range(16)]

    def loss(model, batch):
        return nn.functional.cross_entropy(model(batch["input_ids"].float()), batch["y"])

    return _recipe(dataset=samples, loss_fn=loss, lengths=[0] * 16)


# --- the mistakes of porting a training loop into a recipe ---------------------------------


def backward_in_loss_fn():
    def loss_fn(model, batch):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()  # as the loop it came from did
        return loss

    return _recipe(loss_fn=loss_fn)


def model_instance():
    return _recipe(model=nn.Linear(4, 2))


def optimizer_instance():
    return _recipe(optimizer=torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))


def loss_module():
    return _recipe(loss_fn=nn.CrossEntropyLoss())


def data_loader_as_dataset():
    loader = torch.utils.data.DataLoader(_recipe().dataset, batch_size=8)
    return _recipe(dataset=loader)


def model_class_needs_arguments():
    class Classifier(nn.Module):
        def __init__(self, classes):
            super().__init__()
            self.linear = nn.Linear(4, classes)

        def forward(self, x):
            return self.linear(x)

    return _recipe(model=Classifier)


def loss_fn_of_the_batch_only():
    return _recipe(loss_fn=lambda batch: batch[0].sum())


def loss_per_sample():
    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")

    return _recipe(loss_fn=loss_fn)


def loss_item():
    return _recipe(
        loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]).item()
    )


def tokens_counted_without_a_count():
    return _recipe(count_unit="tokens")


def model_given_the_whole_batch():
    return _recipe(loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch), batch[1]))
