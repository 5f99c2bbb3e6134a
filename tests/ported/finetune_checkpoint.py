# ruff: noqa: F821, B007, B020  (tutorial code; names the test injects: device, init_weights,
#                    checkpoint_dir, train_sampler, images, labels, val_images, val_labels,
#                    ft_images, ft_labels, ft_val_images, ft_val_labels)
"""Pretrain, checkpoint, resume and fine-tune, as PyTorch's "Saving and loading a general
checkpoint" and "Transfer learning" tutorials write it, with a tiny CNN. The test injects the
data (NumPy arrays), ``train_sampler`` (the order of each epoch) and ``checkpoint_dir``.
tests/test_ported_programs.py runs this text under PyTorch and, with only the import lines
changed, under anygpu."""
import time

import torch
from torch import nn, optim
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d((1, 1)),
            nn.Flatten(),
        )
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(self.backbone(x))


PATH = checkpoint_dir / "checkpoint.tar"
criterion = nn.CrossEntropyLoss()
pretrain_loader = DataLoader(TensorDataset(torch.tensor(images), torch.tensor(labels)),
                             batch_size=8, sampler=train_sampler)

# ---- pretraining ----
model = Net()
init_weights(model)
model = model.to(device)
optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

pretrain_losses = []
step_times = []
for epoch in range(2):
    model.train()
    for inputs, targets in pretrain_loader:
        t0 = time.time()
        inputs = inputs.to(device)
        targets = targets.to(device)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        pretrain_losses.append(loss.item())
        step_times.append(time.time() - t0)

torch.save({
    'epoch': epoch,
    'model_state_dict': model.state_dict(),
    'optimizer_state_dict': optimizer.state_dict(),
    'loss': loss,
}, PATH)

# ---- resume from the checkpoint in a new model ----
model = Net()
model.to(device)
optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

checkpoint = torch.load(PATH)
model.load_state_dict(checkpoint['model_state_dict'])
optimizer.load_state_dict(checkpoint['optimizer_state_dict'])
epoch = checkpoint['epoch']
loss = checkpoint['loss']
resumed_from = (epoch, loss.item())

model.eval()
with torch.no_grad():
    val_outputs = model(torch.tensor(val_images).to(device))
    _, val_preds = torch.max(val_outputs, 1)
    pretrain_correct = (val_preds.cpu() == torch.tensor(val_labels)).sum().item()

resume_losses = []
for epoch in range(epoch + 1, epoch + 2):
    model.train()
    for inputs, targets in pretrain_loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss = criterion(model(inputs), targets)
        loss.backward()
        optimizer.step()
        resume_losses.append(loss.item())

# ---- ConvNet as fixed feature extractor: freeze the backbone, replace the head ----
for param in model.backbone.parameters():
    param.requires_grad = False

old_fc = model.fc
num_ftrs = model.fc.in_features
# Parameters of newly constructed modules have requires_grad=True by default
model.fc = nn.Linear(num_ftrs, 2)
model = model.to(device)
# start the new head from the first two classes of the pretrained one, at half scale
with torch.no_grad():
    model.fc.weight.copy_(old_fc.weight[:2])
    model.fc.weight.mul_(0.5)
model.fc.bias.data.copy_(old_fc.bias.data[:2])
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

# Observe that only parameters of final layer are being optimized as opposed to before.
optimizer_conv = optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=0.05,
                           momentum=0.9)
# Decay LR by a factor of 0.1 every 2 epochs
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_conv, step_size=2, gamma=0.1)

dataloaders = {
    'train': DataLoader(TensorDataset(torch.tensor(ft_images), torch.tensor(ft_labels)),
                        batch_size=16, sampler=train_sampler),
    'val': DataLoader(TensorDataset(torch.tensor(ft_val_images), torch.tensor(ft_val_labels)),
                      batch_size=16, shuffle=False),
}
dataset_sizes = {x: len(dataloaders[x].dataset) for x in ['train', 'val']}

finetune_losses = []
history = []
learning_rates = []
for epoch in range(4):
    for phase in ['train', 'val']:
        if phase == 'train':
            model.train()  # Set model to training mode
        else:
            model.eval()  # Set model to evaluate mode

        running_loss = 0.0
        running_corrects = 0

        # Iterate over data.
        for inputs, targets in dataloaders[phase]:
            inputs = inputs.to(device)
            targets = targets.to(device)

            # zero the parameter gradients
            optimizer_conv.zero_grad()

            if phase == 'train':
                outputs = model(inputs)
                _, preds = torch.max(outputs, 1)
                loss = criterion(outputs, targets)
                loss.backward()
                optimizer_conv.step()
                finetune_losses.append(loss.item())
            else:
                with torch.no_grad():
                    outputs = model(inputs)
                    _, preds = torch.max(outputs, 1)
                    loss = criterion(outputs, targets)

            # statistics
            running_loss += loss.item() * inputs.size(0)
            running_corrects += torch.sum(preds == targets.data).item()
        if phase == 'train':
            learning_rates.append(exp_lr_scheduler.get_last_lr()[0])
            exp_lr_scheduler.step()

        epoch_loss = running_loss / dataset_sizes[phase]
        epoch_acc = running_corrects / dataset_sizes[phase]
        history.append((epoch_loss, epoch_acc))
        print(f'{epoch} {phase} Loss: {epoch_loss:.4f} Acc: {epoch_acc:.4f}')

final_state = {k: v.cpu().numpy() for k, v in model.state_dict().items()}
