//! The tokenizer checks ([`crate::agree`]), read at each scrape: which workers tokenize as
//! the router does, and how the checks ended.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::agree::Verdict;
use crate::fleet::Fleet;

#[derive(Debug)]
pub(super) struct TokenizerCheckCollector(pub(super) Arc<Fleet>);

impl Collector for TokenizerCheckCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let verdicts = self.0.verdicts();
        let counts = verdicts.counts();
        if counts.is_empty() {
            return Ok(());
        }
        let mut m = enc.encode_descriptor(
            "kvroute_tokenizer_checks",
            "Workers asked to tokenize the probe text, by result: agrees, differs (the worker's KV events \
             cannot match the router's hashes), unreachable, status (no tokenize endpoint), bad_answer",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in counts {
            ConstCounter::new(n).encode(m.encode_family(&[("result", result)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "kvroute_worker_tokenizer_agrees",
            "1 if the worker's last tokenizer check agreed with the router, 0 if it differed; absent until known",
            None,
            MetricType::Gauge,
        )?;
        for (worker, v) in verdicts.all() {
            let Some(w) = self.0.worker(worker) else { continue };
            let agrees = match v {
                Verdict::Agrees => 1,
                Verdict::Differs { .. } => 0,
                _ => continue,
            };
            let labels = [("model", w.model.clone()), ("worker", worker.to_string())];
            ConstGauge::new(agrees).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
