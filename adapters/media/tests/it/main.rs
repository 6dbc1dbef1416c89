//! kvroute-media against vLLM: the committed fixtures (facts printed by vLLM's wheel),
//! and, when the engine venv is installed, the wheel itself.

mod engine;
mod fixtures;
mod wheel;
