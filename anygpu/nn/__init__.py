"""Neural-network building blocks with PyTorch's names, arguments and state_dict keys, so
torchvision and Hugging Face weights load one to one. ``anygpu.nn.functional`` holds the
functional forms, ``anygpu.nn.init`` the initializations, ``anygpu.nn.state`` safetensors I/O.

>>> import anygpu as ag
>>> from anygpu import nn
>>> model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
...                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
>>> model(ag.randn(2, 3, 16, 16)).shape
(2, 10)
>>> list(model.state_dict())[:4]
['0.weight', '0.bias', '1.weight', '1.bias']
"""

from anygpu.nn import functional, utils, init, state
from anygpu.nn.layers import (GELU, Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d, Dropout,
                              Embedding, Flatten, Hardtanh, Identity, LeakyReLU, Linear,
                              LogSoftmax, PReLU, ReLU, ReLU6, Sigmoid, SiLU, Softmax, Tanh,
                              Unflatten)
from anygpu.nn.loss import BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss
from anygpu.nn.containers import ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from anygpu.nn.distance import CosineSimilarity, PairwiseDistance
from anygpu.nn.upsampling import Upsample, UpsamplingBilinear2d, UpsamplingNearest2d
from anygpu.nn.module import Module, Parameter
from anygpu.nn.attention import MultiheadAttention
from anygpu.nn.transformer import (TransformerDecoderLayer, TransformerEncoder,
                                   TransformerEncoderLayer)
from anygpu.nn.norm import BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RMSNorm
from anygpu.nn.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from anygpu.nn.rnn import (GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell,
                            RNNCellBase)

__all__ = ["functional", "init", "state", "utils", "Module", "Parameter", "Sequential",
           "ModuleList", "ModuleDict", "Identity", "Linear", "Conv2d", "ConvTranspose2d",
           "Embedding", "Dropout", "Flatten", "Unflatten", "ReLU", "GELU", "SiLU", "Sigmoid",
           "Tanh", "LeakyReLU", "Softmax", "LogSoftmax", "BatchNorm1d", "BatchNorm2d", "LayerNorm",
           "RMSNorm", "GroupNorm", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
           "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCEWithLogitsLoss",
           "MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "Conv1d", "ConvTranspose1d", "PReLU", "ParameterList",
           "ParameterDict", "CosineSimilarity", "PairwiseDistance", "Upsample",
           "UpsamplingNearest2d", "UpsamplingBilinear2d", "RNNBase", "RNN", "LSTM", "GRU",
           "RNNCellBase", "RNNCell", "LSTMCell", "GRUCell", "Hardtanh", "ReLU6"]
