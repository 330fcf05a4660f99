"""Chat, as the front and the pipeline share it: messages checked and rendered by the chat template, tools
planned, and an output split into reasoning, content and tool calls by the tool and reasoning parsers."""
