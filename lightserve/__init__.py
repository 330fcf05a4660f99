"""lightserve: a multi-process LLM server. For offline generation from Python:

    from lightserve import pipeline, GenerationConfig
    with pipeline(data_type="float32") as pipe:
        print(pipe.infer("Hello", GenerationConfig(max_new_tokens=32)).text)

NOTE: `lightserve.pipeline` is the function (this import rebinds the name over the submodule);
import the module's other names with `from lightserve.pipeline import ...`. Importing the pipeline
here is light: it pulls in torch, transformers and zmq only when a Pipeline starts.
"""
from lightserve.pipeline import GenerationConfig, Pipeline, Response, pipeline

__all__ = ["GenerationConfig", "Pipeline", "Response", "pipeline"]
