"""Writes the two small files of the python_weights example (run from this
folder; any PyTorch >= 1.13):

  encoder_layer.pt     the state dict of a Python nn.TransformerEncoderLayer,
                       as torch.save(model.state_dict(), path) writes it
  encoder_layer_io.pt  an input batch and the layer's output in Python
                       (eval mode), {"src": (2, 5, 16), "output": (2, 5, 16)}
"""
import torch

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(
    d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
layer.eval()
src = torch.randn(2, 5, 16)
with torch.no_grad():
    output = layer(src)
torch.save(layer.state_dict(), "encoder_layer.pt")
torch.save({"src": src, "output": output}, "encoder_layer_io.pt")
print("wrote encoder_layer.pt and encoder_layer_io.pt with torch",
      torch.__version__)
