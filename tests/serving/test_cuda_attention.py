"""serving/models.py configure_cuda_attention: cuDNN's SDPA backend off on CUDA unless DRAFTSMITH_CUDNN_SDPA=1.
The flag is torch's process-wide switch; it exists (and is checked here) on CPU builds too."""
import torch

from serving.models import configure_cuda_attention


def test_cudnn_sdpa_goes_off_unless_asked_for(monkeypatch):
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setenv("DRAFTSMITH_CUDNN_SDPA", "1")
        assert configure_cuda_attention() is False
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.delenv("DRAFTSMITH_CUDNN_SDPA")
        assert configure_cuda_attention() is True
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
