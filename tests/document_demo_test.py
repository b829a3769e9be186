"""`make demo`'s document and config (lab/document_demo.py). The run itself is `make demo` (two
minutes on 2 CPU cores: its ~850-token prompt goes through four prefills); the path it takes,
generate_text through a plan with the KV on the host against resident caches, is
tests/text_test.py's."""

import pytest

from lab import document_demo


def test_default_document_is_pythons_license():
  text, source = document_demo.read_document(None)
  assert "Python Software Foundation" in text and "B. TERMS" not in text
  assert source.endswith("(section A, the history)")
  with pytest.raises(ValueError, match="does not exist"):
    document_demo.read_document("/no/such/file.txt")
  with pytest.raises(ValueError, match="device_share"):
    document_demo.DocumentDemoConfig(device_share=1.0)
