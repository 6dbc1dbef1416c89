//! Prints, for each image file named on the command line, what kvroute-media makes of
//! it as a `data:` URL: one JSON object per line with the keys
//! `scripts/real-engine/media_check.py images` prints from vLLM's own code.
//!
//! `media-identify MODEL_ID FILE...`; the Qwen2-VL token counts use the script's
//! processor settings (patch 14, merge 2, 3,136 to 50,176 pixels).

use std::process::ExitCode;

use base64::Engine;
use kvroute_media::{Algorithm, ImageIo, ImagePart, Limits, MediaConfig, PlaceholderRule};
use serde_json::{json, Map, Value};

const ALGORITHMS: [(&str, Algorithm); 3] =
    [("blake3", Algorithm::Blake3), ("sha256", Algorithm::Sha256), ("sha512", Algorithm::Sha512)];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((model_id, files)) = args.split_first() else {
        eprintln!("usage: media-identify MODEL_ID FILE...");
        return ExitCode::from(2);
    };
    for file in files {
        match facts(model_id, file) {
            Ok(v) => println!("{v}"),
            Err(e) => {
                eprintln!("{file}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

fn facts(model_id: &str, file: &str) -> Result<Value, Box<dyn std::error::Error>> {
    let bytes = std::fs::read(file)?;
    let url = format!("data:image/x;base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes));
    let rule =
        PlaceholderRule::Qwen2Vl { patch_size: 14, merge_size: 2, min_pixels: 56 * 56, max_pixels: 28 * 28 * 64 };
    let mut ids = Map::new();
    let mut last = None;
    for (name, algorithm) in ALGORITHMS {
        let cfg = MediaConfig {
            model_id: model_id.into(),
            algorithm,
            io: ImageIo::default(),
            rule,
            limits: Limits::default(),
        };
        let image = cfg.resolve(ImagePart { url: Some(&url), uuid: None })?;
        ids.insert(name.into(), image.identifier.clone().into());
        last = Some(image);
    }
    let image = last.ok_or("no algorithm")?;
    let h = image.header.ok_or("no header")?;
    let name = std::path::Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or(file);
    Ok(json!({
        "file": name,
        "size": [h.width, h.height],
        "mode": h.mode,
        "display_size": [h.display_size().0, h.display_size().1],
        "ids": ids,
        "qwen_tokens": image.tokens,
    }))
}
