//! Reading an InferenceDeployment within the bounds of its own CRD schema, as it is read.
//!
//! The schema's `maxItems`, `maxProperties`, `maxLength`, `minimum` and `maximum` (from the
//! schemars attributes of [`super`], constants in [`super::limits`]) are compiled once into a
//! [`Shape`] tree, and [`read`] wraps any serde `Deserializer` so that:
//! - a list or map stops growing at its bound: the rest of its entries are skipped without
//!   being built (counted, so the answer names how many there were), and the value read
//!   holds the first `max` entries;
//! - a string longer than its `maxLength`, or a number outside its range, is recorded.
//!
//! Each breach becomes an [`Excess`] naming the field; the read itself goes on, so one
//! answer lists them all. What a read can allocate is therefore bounded by the schema and
//! by the bytes of the input (strings), never by how many entries an input claims: the
//! webhook reads AdmissionReviews this way, and [`crate::validate::bounds`] checks a spec
//! read by any other means against the same tree.
//!
//! Data-carrying enums are not wrapped (the spec has none; its enums are unit variants).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::rc::Rc;
use std::sync::OnceLock;

use kube_core::CustomResourceExt;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use super::InferenceDeployment;

/// Entries of a list or map whose schema states no bound: a safety net only, since a test
/// (`every_list_and_map_of_the_spec_has_a_bound`) keeps every list and map of the spec bounded.
pub const UNSTATED_ITEMS_MAX: usize = 1024;

/// The bounds of one position of the schema, and of the positions under it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Shape {
    /// `maxItems` of a list, `maxProperties` of a map.
    pub max_items: Option<usize>,
    /// `maxLength` of a string.
    pub max_len: Option<usize>,
    /// `minimum` / `maximum` of a number (`exclusive_min`: `exclusiveMinimum: true`).
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub exclusive_min: bool,
    /// Properties of an object.
    pub properties: BTreeMap<String, Shape>,
    /// Entries of a list.
    pub items: Option<Box<Shape>>,
    /// Values of a map (`additionalProperties`).
    pub values: Option<Box<Shape>>,
}

static EMPTY: Shape = Shape {
    max_items: None,
    max_len: None,
    min: None,
    max: None,
    exclusive_min: false,
    properties: BTreeMap::new(),
    items: None,
    values: None,
};

impl Shape {
    /// Compiles an OpenAPI v3 schema (as the CRD holds it).
    pub fn compile(schema: &Value) -> Shape {
        let usize_of = |key: &str| schema.get(key).and_then(Value::as_u64).map(|n| n as usize);
        Shape {
            max_items: usize_of("maxItems").or_else(|| usize_of("maxProperties")),
            max_len: usize_of("maxLength"),
            min: schema.get("minimum").and_then(Value::as_f64),
            max: schema.get("maximum").and_then(Value::as_f64),
            exclusive_min: schema.get("exclusiveMinimum") == Some(&Value::Bool(true)),
            properties: schema
                .get("properties")
                .and_then(Value::as_object)
                .map(|p| p.iter().map(|(k, v)| (k.clone(), Shape::compile(v))).collect())
                .unwrap_or_default(),
            items: schema.get("items").map(|i| Box::new(Shape::compile(i))),
            values: schema
                .get("additionalProperties")
                .filter(|v| v.is_object())
                .map(|v| Box::new(Shape::compile(v))),
        }
    }

    /// The whole InferenceDeployment object (`metadata`, `spec`, `status`), from its CRD.
    pub fn object() -> &'static Shape {
        static SHAPE: OnceLock<Shape> = OnceLock::new();
        SHAPE.get_or_init(|| {
            let crd = serde_json::to_value(InferenceDeployment::crd()).unwrap_or_default();
            Shape::compile(
                crd.pointer("/spec/versions/0/schema/openAPIV3Schema")
                    .unwrap_or(&Value::Null),
            )
        })
    }

    /// The `spec` of an InferenceDeployment.
    pub fn spec() -> &'static Shape {
        Shape::object().properties.get("spec").unwrap_or(&EMPTY)
    }

    fn property(&self, key: &str) -> &Shape {
        self.properties
            .get(key)
            .or(self.values.as_deref())
            .unwrap_or(&EMPTY)
    }
}

/// What was over a bound.
#[derive(Clone, Debug, PartialEq)]
pub enum Breach {
    /// A list or map had `found` entries, more than `max`.
    Entries { found: usize, max: usize },
    /// A string was `found` characters long, more than `max`.
    Length { found: usize, max: usize },
    /// A number (as written) was below the minimum (`exclusive`: at or below it).
    BelowMinimum {
        value: String,
        min: f64,
        exclusive: bool,
    },
    /// A number (as written) was above the maximum.
    AboveMaximum { value: String, max: f64 },
}

/// One value over its bound: the field (`spec.network.allowFrom`) and the bound.
#[derive(Clone, Debug, PartialEq)]
pub struct Excess {
    pub field: String,
    pub breach: Breach,
}

type Report = RefCell<Vec<Excess>>;

/// Reads a `T` from `de` at the schema position `shape` (whose field path is `root`, e.g.
/// `spec`, or empty for the whole object), returning it with every bound it broke. Lists
/// and maps over their bound hold their first `max` entries.
pub fn read<'de, T, D>(de: D, shape: &Shape, root: &str) -> Result<(T, Vec<Excess>), D::Error>
where
    T: Deserialize<'de>,
    D: Deserializer<'de>,
{
    let report = Report::default();
    let value = T::deserialize(Reader {
        de,
        at: At {
            shape,
            path: root.to_string(),
            report: &report,
            key: None,
        },
    })?;
    Ok((value, report.into_inner()))
}

/// Walks any value without keeping it, so that [`read`] can check a value it need not build.
pub struct Walk;

impl<'de> Deserialize<'de> for Walk {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_any(WalkVisitor)
    }
}

struct WalkVisitor;

impl<'de> Visitor<'de> for WalkVisitor {
    type Value = Walk;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_str<E>(self, _: &str) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_unit<E>(self) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_none<E>(self) -> Result<Walk, E> {
        Ok(Walk)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Walk, D::Error> {
        Walk::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Walk, A::Error> {
        while seq.next_element::<Walk>()?.is_some() {}
        Ok(Walk)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Walk, A::Error> {
        while map.next_key::<Walk>()?.is_some() {
            map.next_value::<Walk>()?;
        }
        Ok(Walk)
    }
}

// === impl Reader ===

/// Where a reader is: the schema position, its field path, the breaches so far, and (for
/// map keys) where to put the key read.
struct At<'s, 'r> {
    shape: &'s Shape,
    path: String,
    report: &'r Report,
    key: Option<Rc<RefCell<Option<String>>>>,
}

impl<'s, 'r> At<'s, 'r> {
    fn child(&self, shape: &'s Shape, path: String) -> At<'s, 'r> {
        At {
            shape,
            path,
            report: self.report,
            key: None,
        }
    }

    fn breach(&self, breach: Breach) {
        self.report.borrow_mut().push(Excess {
            field: self.path.clone(),
            breach,
        });
    }

    /// Checks a number against the range; `exact` writes it (an i64 is not exact as f64).
    fn number(&self, value: f64, exact: &dyn fmt::Display) {
        let s = self.shape;
        match (s.min, s.max) {
            (Some(min), _) if value < min || (s.exclusive_min && value <= min) => {
                self.breach(Breach::BelowMinimum {
                    value: exact.to_string(),
                    min,
                    exclusive: s.exclusive_min,
                })
            }
            (_, Some(max)) if value > max => self.breach(Breach::AboveMaximum {
                value: exact.to_string(),
                max,
            }),
            _ => {}
        }
    }

    fn string(&self, s: &str) {
        if let Some(slot) = &self.key {
            *slot.borrow_mut() = Some(s.to_string());
        }
        if let Some(max) = self.shape.max_len {
            // maxLength counts characters, as the API server does.
            let found = s.chars().count();
            if found > max {
                self.breach(Breach::Length { found, max });
            }
        }
    }

    fn max_items(&self) -> usize {
        self.shape.max_items.unwrap_or(UNSTATED_ITEMS_MAX)
    }
}

struct Reader<'s, 'r, D> {
    de: D,
    at: At<'s, 'r>,
}

macro_rules! forward {
    ($($method:ident),*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            self.de.$method(Wrap { inner: visitor, at: self.at })
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Reader<'_, '_, D> {
    type Error = D::Error;

    forward!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de.deserialize_unit_struct(
            name,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de.deserialize_newtype_struct(
            name,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.de.deserialize_tuple(
            len,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de.deserialize_tuple_struct(
            name,
            len,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de.deserialize_struct(
            name,
            fields,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.de.deserialize_enum(
            name,
            variants,
            Wrap {
                inner: visitor,
                at: self.at,
            },
        )
    }

    fn is_human_readable(&self) -> bool {
        self.de.is_human_readable()
    }
}

/// A visitor that checks what it is shown against the schema, then hands it on.
struct Wrap<'s, 'r, V> {
    inner: V,
    at: At<'s, 'r>,
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<'_, '_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.inner.expecting(f)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<V::Value, E> {
        self.inner.visit_bool(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<V::Value, E> {
        self.at.number(v as f64, &v);
        self.inner.visit_i64(v)
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<V::Value, E> {
        self.at.number(v as f64, &v);
        self.inner.visit_i128(v)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<V::Value, E> {
        self.at.number(v as f64, &v);
        self.inner.visit_u64(v)
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<V::Value, E> {
        self.at.number(v as f64, &v);
        self.inner.visit_u128(v)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<V::Value, E> {
        self.at.number(v, &v);
        self.inner.visit_f64(v)
    }
    fn visit_char<E: de::Error>(self, v: char) -> Result<V::Value, E> {
        self.inner.visit_char(v)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<V::Value, E> {
        self.at.string(v);
        self.inner.visit_str(v)
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<V::Value, E> {
        self.at.string(v);
        self.inner.visit_borrowed_str(v)
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<V::Value, E> {
        self.at.string(&v);
        self.inner.visit_string(v)
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<V::Value, E> {
        self.inner.visit_bytes(v)
    }
    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<V::Value, E> {
        self.inner.visit_borrowed_bytes(v)
    }
    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<V::Value, E> {
        self.inner.visit_byte_buf(v)
    }
    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }
    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }
    fn visit_some<D2: Deserializer<'de>>(self, d: D2) -> Result<V::Value, D2::Error> {
        self.inner.visit_some(Reader { de: d, at: self.at })
    }
    fn visit_newtype_struct<D2: Deserializer<'de>>(self, d: D2) -> Result<V::Value, D2::Error> {
        self.inner.visit_newtype_struct(Reader { de: d, at: self.at })
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.inner.visit_seq(Seq {
            seq,
            at: self.at,
            count: 0,
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(Map {
            map,
            at: self.at,
            count: 0,
            key: Rc::default(),
        })
    }
    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.inner.visit_enum(data)
    }
}

/// A list that stops at its bound.
struct Seq<'s, 'r, A> {
    seq: A,
    at: At<'s, 'r>,
    count: usize,
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Seq<'_, '_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        let max = self.at.max_items();
        if self.count >= max {
            let mut found = self.count;
            while self.seq.next_element::<IgnoredAny>()?.is_some() {
                found += 1;
            }
            if found > max {
                self.at.breach(Breach::Entries { found, max });
            }
            return Ok(None);
        }
        let shape = self.at.shape.items.as_deref().unwrap_or(&EMPTY);
        let at = self.at.child(shape, format!("{}[{}]", self.at.path, self.count));
        self.count += 1;
        self.seq.next_element_seed(Seed { seed, at })
    }

    fn size_hint(&self) -> Option<usize> {
        self.seq.size_hint().map(|n| n.min(self.at.max_items()))
    }
}

/// A map (or an object) that stops at its bound.
struct Map<'s, 'r, A> {
    map: A,
    at: At<'s, 'r>,
    count: usize,
    key: Rc<RefCell<Option<String>>>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Map<'_, '_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        let max = self.at.max_items();
        if self.count >= max {
            let mut found = self.count;
            while self.map.next_key::<IgnoredAny>()?.is_some() {
                self.map.next_value::<IgnoredAny>()?;
                found += 1;
            }
            if found > max {
                self.at.breach(Breach::Entries { found, max });
            }
            return Ok(None);
        }
        self.count += 1;
        let mut at = self.at.child(&EMPTY, self.at.path.clone());
        at.key = Some(self.key.clone());
        self.map.next_key_seed(Seed { seed, at })
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        let key = self.key.borrow_mut().take().unwrap_or_default();
        let shape = self.at.shape.property(&key);
        let path = if self.at.path.is_empty() {
            key
        } else {
            format!("{}.{key}", self.at.path)
        };
        let at = self.at.child(shape, path);
        self.map.next_value_seed(Seed { seed, at })
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint().map(|n| n.min(self.at.max_items()))
    }
}

/// Hands the reader on to the next entry.
struct Seed<'s, 'r, T> {
    seed: T,
    at: At<'s, 'r>,
}

impl<'de, T: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, '_, T> {
    type Value = T::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<T::Value, D::Error> {
        self.seed.deserialize(Reader { de, at: self.at })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::limits::*;
    use crate::api::InferenceDeploymentSpec;
    use serde_json::json;

    fn read_spec(v: &Value) -> (InferenceDeploymentSpec, Vec<Excess>) {
        read(v, Shape::spec(), "spec").unwrap()
    }

    fn base() -> Value {
        json!({"model": {"name": "m", "geometry": {"layers": 2, "queryHeads": 2, "kvHeads": 2, "headDim": 64}}})
    }

    #[test]
    fn a_list_over_its_bound_keeps_its_first_entries_and_names_how_many_there_were() {
        let mut v = base();
        let peer = json!({"podSelector": {"matchLabels": {"app": "a"}}});
        v["network"] = json!({"allowFrom": vec![peer; 1000]});
        let (spec, excess) = read_spec(&v);
        assert_eq!(spec.network.unwrap().allow_from.len(), ALLOW_FROM_MAX);
        assert_eq!(
            excess,
            vec![Excess {
                field: "spec.network.allowFrom".into(),
                breach: Breach::Entries {
                    found: 1000,
                    max: ALLOW_FROM_MAX
                }
            }]
        );
    }

    #[test]
    fn nested_lists_maps_strings_and_numbers_are_each_named_and_the_read_goes_on() {
        let mut v = base();
        let values: Vec<String> = (0..=PEER_TERMS_MAX).map(|i| format!("v{i}")).collect();
        let labels: serde_json::Map<String, Value> = (0..=PEER_TERMS_MAX)
            .map(|i| (format!("k{i}"), json!("v")))
            .collect();
        v["network"] = json!({"allowFrom": [
            {"podSelector": {"matchExpressions": [{"key": "k", "operator": "In", "values": values}]}},
            {"namespaceSelector": {"matchLabels": labels}},
        ]});
        v["engine"] = json!({"maxNumSeqs": 0, "image": "i".repeat(IMAGE_LEN_MAX + 1)});
        v["replicas"] = json!(-1);
        let (_, excess) = read_spec(&v);
        let fields: Vec<&str> = excess.iter().map(|e| e.field.as_str()).collect();
        // In the order read (a `Value` keeps its keys sorted).
        assert_eq!(
            fields,
            [
                "spec.engine.image",
                "spec.engine.maxNumSeqs",
                "spec.network.allowFrom[0].podSelector.matchExpressions[0].values",
                "spec.network.allowFrom[1].namespaceSelector.matchLabels",
                "spec.replicas",
            ]
        );
        assert_eq!(
            excess[1].breach,
            Breach::BelowMinimum {
                value: "0".into(),
                min: 1.0,
                exclusive: false
            }
        );
    }

    /// Every list and map of the spec's schema, with its bound (`None`: unbounded).
    fn containers(schema: &Value, path: String, out: &mut Vec<(String, Option<u64>)>) {
        let bound = |key: &str| schema.get(key).and_then(Value::as_u64);
        if let Some(items) = schema.get("items") {
            out.push((path.clone(), bound("maxItems")));
            containers(items, format!("{path}[]"), out);
        }
        if let Some(values) = schema.get("additionalProperties").filter(|v| v.is_object()) {
            out.push((path.clone(), bound("maxProperties")));
            containers(values, format!("{path}{{}}"), out);
        }
        for (key, property) in schema
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            containers(property, format!("{path}.{key}"), out);
        }
    }

    #[test]
    fn every_list_and_map_of_the_spec_has_a_bound() {
        let crd = serde_json::to_value(InferenceDeployment::crd()).unwrap();
        let spec = crd
            .pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec")
            .unwrap();
        let mut all = Vec::new();
        containers(spec, "spec".into(), &mut all);
        assert!(all.len() > 20, "{all:?}");
        let unbounded: Vec<&String> = all.iter().filter(|(_, b)| b.is_none()).map(|(p, _)| p).collect();
        assert!(
            unbounded.is_empty(),
            "lists or maps without maxItems/maxProperties: {unbounded:?}"
        );
        // And the reader holds the same bounds.
        assert_eq!(
            Shape::spec().properties["network"].properties["allowFrom"].max_items,
            Some(ALLOW_FROM_MAX)
        );
    }

    #[test]
    fn a_spec_within_its_bounds_reads_as_it_would_without_them() {
        let mut v = base();
        v["network"] = json!({"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]});
        v["pod"] = json!({"annotations": {"a": "b"}, "resources": {"limits": {"cpu": "2"}}});
        let (spec, excess) = read_spec(&v);
        assert_eq!(excess, vec![]);
        assert_eq!(
            spec,
            serde_json::from_value::<InferenceDeploymentSpec>(v).unwrap()
        );
    }
}
