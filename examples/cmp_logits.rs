use baton::engine::Session;
use baton::kernels::ThreadPool;
use baton::model::Model;
use std::sync::Arc;
fn main() {
    // cmp_logits MODEL [LEVEL]: LEVEL is the llama.cpp build of the golden (avx2, avx512; default avx512).
    let name = std::env::args().nth(1).unwrap();
    let level = std::env::args().nth(2).unwrap_or_else(|| "avx512".into());
    let path = format!("tests/golden/greedy-{name}-{level}.json");
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let model = Arc::new(Model::load(&baton::fetch::resolve(&name).unwrap()).unwrap());
    for p in g["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = p["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let mut s = Session::new(model.clone(), Arc::new(ThreadPool::new(2)), 2048, 512).unwrap();
        let l = s.eval(&ids).unwrap().to_vec();
        let mean: f64 = l.iter().map(|&x| x as f64).sum::<f64>() / l.len() as f64;
        let std = (l.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / l.len() as f64).sqrt();
        print!(
            "{} mean {:.4} vs {:.4} std {:.4} vs {:.4} | diffs:",
            p["label"], mean, p["last_prompt_logits"]["mean"], std, p["last_prompt_logits"]["std"]
        );
        for pair in p["last_prompt_logits"]["top20"].as_array().unwrap().iter().take(8) {
            let id = pair[0].as_u64().unwrap() as usize;
            print!(" {:.3}", l[id] as f64 - pair[1].as_f64().unwrap());
        }
        println!();
    }
}
