//! Replays every corpus payload through the decoder and the ingestion core: nothing
//! may panic, `bad_*` must be refused, everything else accepted. A fuzz target can
//! start from the same folder.

use std::fs;

use bytes::Bytes;
use kvroute_events::decode::{decode_batch, Batch, DecodeConfig};
use kvroute_events::ingest::IngestError;
use kvroute_events::{IngestConfig, IngestCore, StreamConfig};
use router_core::{BlockSize, Instant, WorkerKey};

use crate::support::{crate_dir, ModelSink};

#[test]
fn every_corpus_file_gives_a_typed_result() {
    let dir = crate_dir().join("tests/corpus");
    let mut files: Vec<_> = fs::read_dir(&dir).expect("corpus").map(|e| e.expect("entry").path()).collect();
    files.sort();
    assert!(files.len() >= 20, "corpus has {} files", files.len());
    let key = WorkerKey::new(1, 0);
    let mut core = IngestCore::new(IngestConfig::default());
    let cfg = StreamConfig {
        key,
        block_size: BlockSize::new(4).expect("4"),
        cache_salt: None,
        blocks_max: 64,
        has_replay: false,
    };
    core.add_stream(Instant::ZERO, cfg).expect("add");
    let mut sink = ModelSink::default();
    let mut batch = Batch::new();
    for (seq, path) in files.iter().enumerate() {
        let name = path.file_name().and_then(|n| n.to_str()).expect("utf-8 name").to_string();
        let payload = fs::read(path).expect("read");
        let result = decode_batch(&payload, &DecodeConfig::default(), &mut batch);
        if name.starts_with("bad_") {
            assert!(result.is_err(), "{name} was accepted");
        } else {
            assert!(result.is_ok(), "{name}: {result:?}");
        }
        let frames = [Bytes::new(), Bytes::copy_from_slice(&(seq as u64).to_be_bytes()), Bytes::from(payload)];
        match core.handle_live(Instant::ZERO, key, &frames, &mut sink) {
            Ok(()) | Err(IngestError::Decode(_) | IngestError::Translate(_)) => {}
            Err(e) => panic!("{name}: unexpected {e}"),
        }
    }
}
