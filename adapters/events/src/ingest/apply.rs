//! Carrying out a stream's sequencer outputs: decode, translate, hand to the sink.

use router_core::{DpRank, WorkerKey};

use super::{stream_keys, Command, IngestCore, IngestError, Notice, Stream};
use crate::decode::{decode_batch, Batch, DecodeConfig};
use crate::sequence::SeqOutput;
use crate::translate::{EventSink, RouterEvent, TranslateConfig, TranslateError, Translator};

/// What applying needs besides the stream, borrowed apart from it.
struct Ctx<'c> {
    decode: &'c DecodeConfig,
    ranks_max: usize,
    kv_group: u32,
    map_seed: u64,
    batch: &'c mut Batch,
    scratch: &'c mut Vec<RouterEvent>,
    notices: &'c mut std::collections::VecDeque<Notice>,
}

impl IngestCore {
    /// Drains `key`'s sequencer; returns the first problem met while applying.
    pub(super) fn drain(&mut self, key: WorkerKey, sink: &mut impl EventSink) -> Result<(), IngestError> {
        let Some(stream) = self.streams.get_mut(&key) else {
            return Ok(());
        };
        let mut ctx = Ctx {
            decode: &self.cfg.decode,
            ranks_max: self.cfg.ranks_max_per_stream,
            kv_group: self.cfg.kv_group,
            map_seed: self.cfg.map_seed,
            batch: &mut self.batch,
            scratch: &mut self.scratch,
            notices: &mut self.notices,
        };
        let mut first = Ok(());
        while let Some(out) = stream.seq.poll_output() {
            let r = match out {
                SeqOutput::Apply { payload, .. } => apply_batch(stream, &mut ctx, &payload, sink),
                SeqOutput::Clear => {
                    for k in stream_keys(stream) {
                        sink.clear_worker(k);
                    }
                    for t in stream.ranks.values_mut() {
                        t.clear();
                    }
                    Ok(())
                }
                SeqOutput::Trusted(trusted) => {
                    stream.status.trusted = trusted;
                    for k in stream_keys(stream) {
                        sink.set_trusted(k, trusted);
                    }
                    Ok(())
                }
                SeqOutput::RequestReplay { id, from } => {
                    self.commands.push_back(Command::Replay { key, id, from });
                    Ok(())
                }
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

fn apply_batch(
    stream: &mut Stream,
    ctx: &mut Ctx<'_>,
    payload: &[u8],
    sink: &mut impl EventSink,
) -> Result<(), IngestError> {
    let key = stream.cfg.key;
    if let Err(e) = decode_batch(payload, ctx.decode, ctx.batch) {
        stream.status.batches_malformed += 1;
        let error = IngestError::Decode(e);
        ctx.notices.push_back(Notice { key, error, config: false });
        return Err(error);
    }
    let st = ctx.batch.stats;
    stream.status.events_unknown += u64::from(st.unknown_events);
    stream.status.fields_unknown += u64::from(st.unknown_fields);
    stream.status.events_dropped += u64::from(st.malformed_events);
    let mut first = match st.first_event_error {
        Some(e) => Err(IngestError::Decode(e)),
        None => Ok(()),
    };
    let rank = ctx.batch.dp_rank.map_or(key.rank, DpRank);
    let target = WorkerKey { worker: key.worker, rank };
    if !stream.ranks.contains_key(&rank) && stream.ranks.len() >= ctx.ranks_max {
        stream.status.events_dropped += ctx.batch.len() as u64;
        return Err(IngestError::TooManyRanks);
    }
    let translator = stream.ranks.entry(rank).or_insert_with(|| {
        Translator::new(TranslateConfig {
            block_size: stream.cfg.block_size,
            cache_salt: stream.cfg.cache_salt.clone(),
            blocks_max: stream.cfg.blocks_max,
            kv_group: ctx.kv_group,
            map_seed: ctx.map_seed,
        })
    });
    let before = *translator.stats();
    for ev in ctx.batch.events() {
        ctx.scratch.clear();
        match translator.translate(ev, ctx.scratch) {
            Ok(()) => {
                stream.status.events_applied += 1;
                for out in ctx.scratch.iter() {
                    sink.apply(target, out);
                }
            }
            Err(e) => {
                stream.status.events_dropped += 1;
                let config = matches!(e, TranslateError::BlockSizeMismatch { .. });
                let error = IngestError::Translate(e);
                if config && stream.status.config_error.is_none() {
                    stream.status.config_error = Some(e);
                    ctx.notices.push_back(Notice { key, error, config: true });
                }
                if first.is_ok() {
                    first = Err(error);
                }
            }
        }
    }
    let after = translator.stats();
    stream.status.blocks_media += after.media_blocks - before.media_blocks;
    stream.status.blocks_unmatchable += after.opaque_blocks - before.opaque_blocks;
    stream.status.batches_applied += 1;
    first
}
