//! The chat templates of seven model families render what transformers'
//! `apply_chat_template` renders, byte for byte: the fixtures under
//! `tests/fixtures/chat_templates/` hold each template as the model ships it and the prompts
//! transformers made of a set of conversations (`generate.py` there makes them).

use kvfleet_engine::model::chat_template::{ChatInputs, ChatTemplate, NaiveDateTime, TemplateValue};

const FAMILIES: [&str; 7] = [
    "smollm2", "gemma3", "qwen2_5", "qwen3", "llama3_1", "mistral", "gpt_oss",
];

fn fixture(family: &str) -> (String, TemplateValue) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates");
    let template = std::fs::read_to_string(dir.join(format!("{family}.jinja"))).unwrap();
    let text = std::fs::read_to_string(dir.join(format!("{family}.json"))).unwrap();
    // Read as template values straight from the text: maps keep the order transformers saw.
    (template, serde_json::from_str(&text).unwrap())
}

fn get(v: &TemplateValue, key: &str) -> Option<TemplateValue> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined())
}

fn items(v: &TemplateValue) -> Vec<TemplateValue> {
    v.try_iter().map(|it| it.collect()).unwrap_or_default()
}

fn inputs(case: &TemplateValue, now: NaiveDateTime) -> (ChatInputs, Vec<(&'static str, String)>) {
    let flag = |k: &str| get(case, k).is_some_and(|v| v.is_true());
    let kwargs = get(case, "kwargs")
        .map(|k| {
            items(&k)
                .into_iter()
                .map(|name| {
                    let value = k.get_item(&name).unwrap();
                    (name.as_str().unwrap().to_string(), value)
                })
                .collect()
        })
        .unwrap_or_default();
    let specials_map = get(case, "specials").unwrap();
    let specials = ["bos_token", "eos_token"]
        .into_iter()
        .filter_map(|k| Some((k, get(&specials_map, k)?.as_str()?.to_string())))
        .collect();
    let inputs = ChatInputs {
        messages: items(&get(case, "messages").unwrap()),
        tools: get(case, "tools"),
        documents: None,
        add_generation_prompt: flag("add_generation_prompt"),
        continue_final_message: flag("continue_final_message"),
        kwargs,
        template: None,
        now: Some(now),
    };
    (inputs, specials)
}

#[test]
fn each_familys_template_renders_what_transformers_renders_byte_for_byte() {
    let mut failures = Vec::new();
    let mut rendered = 0;
    for family in FAMILIES {
        let (source, fixture) = fixture(family);
        let template = ChatTemplate::new(&source);
        template.check().unwrap_or_else(|e| panic!("{family}: {e}"));
        let now = NaiveDateTime::parse_from_str(
            get(&fixture, "now").unwrap().as_str().unwrap(),
            "%Y-%m-%dT%H:%M:%S",
        )
        .unwrap();
        for case in items(&get(&fixture, "cases").unwrap()) {
            let name = get(&case, "name").unwrap().to_string();
            let (inputs, specials) = inputs(&case, now);
            let ours = template.render(&inputs, &specials);
            match (get(&case, "prompt"), ours) {
                (Some(want), Ok(got)) if want.as_str() == Some(got.as_str()) => rendered += 1,
                (Some(want), Ok(got)) => failures.push(format!(
                    "{family} / {name}:\n--- transformers\n{}\n--- kvfleet\n{got}",
                    want.as_str().unwrap()
                )),
                (Some(_), Err(e)) => failures.push(format!("{family} / {name}: {e}")),
                (None, Ok(got)) => failures.push(format!(
                    "{family} / {name}: transformers refused it, kvfleet rendered\n{got}"
                )),
                (None, Err(_)) => {}
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(rendered >= 40, "only {rendered} prompts compared");
}
