# ruff: noqa: F821  (names the test injects: device, init_weights, train_sampler, images,
#                    labels, val_images, val_labels)
"""Fine-tuning with ``train_model`` as PyTorch's "Transfer learning for computer vision"
tutorial writes it (``torch.set_grad_enabled(phase == 'train')``,
``running_corrects.double()``, the best weights kept in a temporary directory), on a dataset
written as the "Writing custom datasets" tutorial writes one (a ``ToTensor`` transform with
``torch.from_numpy``). tests/test_ported_programs.py runs this text under PyTorch and, with
only the import lines changed, under anygpu."""
import os
import time
from tempfile import TemporaryDirectory

import numpy as np

import torch
import torch.nn as nn
import torch.optim as optim
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, Dataset


class ToTensor(object):
    """Convert ndarrays in sample to Tensors."""

    def __call__(self, sample):
        image, label = sample['image'], sample['label']
        return {'image': torch.from_numpy(image), 'label': torch.from_numpy(label)}


class SquaresDataset(Dataset):
    """Squares dataset."""

    def __init__(self, images, labels, transform=None):
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        if torch.is_tensor(idx):
            idx = idx.tolist()
        sample = {'image': self.images[idx], 'label': np.array(self.labels[idx])}
        if self.transform:
            sample = self.transform(sample)
        return sample


image_datasets = {'train': SquaresDataset(images, labels, transform=ToTensor()),
                  'val': SquaresDataset(val_images, val_labels, transform=ToTensor())}
dataloaders = {'train': DataLoader(image_datasets['train'], batch_size=16,
                                   sampler=train_sampler, num_workers=0),
               'val': DataLoader(image_datasets['val'], batch_size=16, shuffle=False,
                                 num_workers=0)}
dataset_sizes = {x: len(image_datasets[x]) for x in ['train', 'val']}
step_losses = []


def train_model(model, criterion, optimizer, scheduler, num_epochs=25):
    since = time.time()

    # Create a temporary directory to save training checkpoints
    with TemporaryDirectory() as tempdir:
        best_model_params_path = os.path.join(tempdir, 'best_model_params.pt')

        torch.save(model.state_dict(), best_model_params_path)
        best_acc = 0.0

        for epoch in range(num_epochs):
            print(f'Epoch {epoch}/{num_epochs - 1}')
            print('-' * 10)

            # Each epoch has a training and validation phase
            for phase in ['train', 'val']:
                if phase == 'train':
                    model.train()  # Set model to training mode
                else:
                    model.eval()   # Set model to evaluate mode

                running_loss = 0.0
                running_corrects = 0

                # Iterate over data.
                for sample in dataloaders[phase]:
                    inputs = sample['image'].to(device)
                    labels = sample['label'].to(device)

                    # zero the parameter gradients
                    optimizer.zero_grad()

                    # forward
                    # track history if only in train
                    with torch.set_grad_enabled(phase == 'train'):
                        outputs = model(inputs)
                        _, preds = torch.max(outputs, 1)
                        loss = criterion(outputs, labels)

                        # backward + optimize only if in training phase
                        if phase == 'train':
                            loss.backward()
                            optimizer.step()
                            step_losses.append(loss.item())

                    # statistics
                    running_loss += loss.item() * inputs.size(0)
                    running_corrects += torch.sum(preds == labels.data)
                if phase == 'train':
                    scheduler.step()

                epoch_loss = running_loss / dataset_sizes[phase]
                epoch_acc = running_corrects.double() / dataset_sizes[phase]

                print(f'{phase} Loss: {epoch_loss:.4f} Acc: {epoch_acc:.4f}')

                # deep copy the model
                if phase == 'val' and epoch_acc > best_acc:
                    best_acc = epoch_acc
                    torch.save(model.state_dict(), best_model_params_path)

            print()

        time_elapsed = time.time() - since
        print(f'Training complete in {time_elapsed // 60:.0f}m {time_elapsed % 60:.0f}s')
        print(f'Best val Acc: {best_acc:4f}')

        # load best model weights
        model.load_state_dict(torch.load(best_model_params_path, weights_only=True))
    return model


model_ft = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(8 * 8 * 8, 4),
)
init_weights(model_ft)
model_ft = model_ft.to(device)

criterion = nn.CrossEntropyLoss()

# Observe that all parameters are being optimized
optimizer_ft = optim.SGD(model_ft.parameters(), lr=0.01, momentum=0.9)

# Decay LR by a factor of 0.1 every 7 epochs
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_ft, step_size=7, gamma=0.1)

model_ft = train_model(model_ft, criterion, optimizer_ft, exp_lr_scheduler, num_epochs=3)
